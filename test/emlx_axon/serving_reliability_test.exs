# Runs only where Nx is available (see serving_test.exs).
if Code.ensure_loaded?(Nx.Serving) do
  defmodule EMLXAxon.TextGeneration.ServingReliabilityTest do
    # A serving process under failure: its own schedulers killed under
    # waiting callers, callers killed mid-stream, a full queue, and 64
    # callers at once with random kills, give-ups and bad inputs. Not
    # async: it reads MLX's global memory figures.
    use ExUnit.Case, async: false

    import EMLXAxon.TestCallers
    import EMLXAxon.TestMemory

    alias EMLXAxon.{Error, TestFixtures, TextGeneration}

    @moduletag :fixtures
    @moduletag timeout: 240_000

    @fixture "qwen3-4bit-g64"
    @plain "The quick brown fox jumps over the lazy dog."
    @long [max_new_tokens: 2000, ignore_eos: true]

    setup_all do
      %{state: TestFixtures.model(@fixture), tokenizer: TestFixtures.tokenizer(@fixture)}
    end

    defp start_serving(ctx, opts, process_opts \\ []) do
      name = :"serving_#{System.unique_integer([:positive])}"
      serving = TextGeneration.serving(ctx.tokenizer, ctx.state, opts)

      start_supervised!(
        {Nx.Serving,
         Keyword.merge(
           [serving: serving, name: name, batch_size: 8, batch_timeout: 10],
           process_opts
         )},
        id: name
      )

      name
    end

    # The schedulers a default serving started, by partition.
    defp schedulers(name) do
      %{module_state: %{owned: supervisor}} = :sys.get_state(name)

      supervisor
      |> Supervisor.which_children()
      |> Enum.sort()
      |> Enum.map(fn {_partition, pid, _, _} -> pid end)
    end

    defp restarted(name, old) do
      wait_until(
        fn -> Enum.all?(schedulers(name), &(is_pid(&1) and &1 not in old)) end,
        2_000
      )
    end

    test "the serving's own scheduler has the serving's batch size in slots", ctx do
      sized = [compile: [batch_size: 3]]
      [three] = schedulers(start_serving(ctx, sized, batch_size: 3))
      assert %{slots: 3} = EMLXAxon.Scheduler.occupancy(three)

      given = sized ++ [scheduler_options: [slots: 2]]
      [given] = schedulers(start_serving(ctx, given, batch_size: 3))

      assert %{slots: 2} = EMLXAxon.Scheduler.occupancy(given)
      [default] = schedulers(start_serving(ctx, []))
      assert %{slots: 8} = EMLXAxon.Scheduler.occupancy(default)
    end

    test "the serving's scheduler killed under its callers: errors within a second, then service",
         ctx do
      plain = start_serving(ctx, @long)
      streaming = start_serving(ctx, @long ++ [stream: true, stream_done: true])
      test = self()

      tasks = [
        caller(fn -> Nx.Serving.batched_run(plain, @plain) end),
        caller(fn -> Nx.Serving.batched_run(plain, ["Hello", "Hi"]) end),
        caller(fn ->
          streaming
          |> Nx.Serving.batched_run("Elixir is")
          |> Stream.each(fn _ -> send(test, :streamed) end)
          |> Stream.run()
        end)
      ]

      assert_receive :streamed, 30_000

      [scheduler] = schedulers(plain)
      [other] = schedulers(streaming)
      wait_until(fn -> EMLXAxon.Scheduler.occupancy(scheduler).running == 3 end, 30_000)
      Process.exit(scheduler, :kill)
      Process.exit(other, :kill)

      for {_task, result} <- Task.yield_many(tasks, 1_000) do
        assert {:ok, {:raised, %Error{kind: :scheduler_down}}} = result
      end

      restarted(plain, [scheduler])
      restarted(streaming, [other])
      opts = [max_new_tokens: 8]
      %{results: [expected]} = TextGeneration.run(ctx.tokenizer, ctx.state, @plain, opts)
      short = start_serving(ctx, opts)
      assert %{results: [^expected]} = Nx.Serving.batched_run(short, @plain)
      assert %{results: [%{num_tokens: 2000}]} = Nx.Serving.batched_run(plain, "Hi")
    end

    test "a static serving stops a batch whose callers all exited", ctx do
      name = start_serving(ctx, @long ++ [stream: true, scheduler: false])
      test = self()

      reader =
        spawn(fn ->
          name
          |> Nx.Serving.batched_run(@plain)
          |> Stream.each(fn _ -> send(test, :streamed) end)
          |> Stream.run()
        end)

      assert_receive :streamed, 30_000
      Process.exit(reader, :kill)

      # The next request gets its first token once the dead caller's batch
      # has stopped (a step later), not after its 2000 tokens.
      started = System.monotonic_time(:millisecond)
      assert [_] = name |> Nx.Serving.batched_run("Hello") |> Enum.take(1)
      waited = System.monotonic_time(:millisecond) - started

      %{metadata: %{decode_ms: decode_ms}} =
        TextGeneration.run(ctx.tokenizer, ctx.state, @plain, max_new_tokens: 200)

      assert waited < decode_ms, "waited #{waited} ms; 200 tokens decode in #{decode_ms} ms"
    end

    test "a full queue answers at once", ctx do
      name = start_serving(ctx, @long ++ [max_queue: 0, scheduler_options: [slots: 1]])

      test = self()

      running =
        caller(fn ->
          name
          |> Nx.Serving.batched_run(@plain)
          |> tap(fn _ -> send(test, :done) end)
        end)

      [scheduler] = schedulers(name)
      wait_until(fn -> EMLXAxon.Scheduler.occupancy(scheduler).running == 1 end, 30_000)
      started = System.monotonic_time(:millisecond)

      assert_raise Error, ~r/overloaded/, fn -> Nx.Serving.batched_run(name, "Hi") end
      assert System.monotonic_time(:millisecond) - started < 1_000
      Task.shutdown(running, :brutal_kill)
      refute_received :done
    end

    test "a bad queue bound or scheduler option names the option", ctx do
      for {opts, message} <- [
            {[max_queue: -1], ~r/:max_queue/},
            {[scheduler_options: [slots: 0]], ~r/:slots/},
            {[scheduler_options: [model: ctx.state]], ~r/:scheduler_options/}
          ] do
        assert_raise ArgumentError, message, fn ->
          TextGeneration.serving(ctx.tokenizer, ctx.state, opts)
        end
      end
    end

    # 64 callers on a default serving: some read their answer, some are
    # killed, some give up after a while, some send bad inputs; the
    # serving's scheduler is killed twice meanwhile. Every caller alive to
    # the end gets an answer (an output or an error), and MLX's memory
    # comes back to what it was.
    test "chaos: 64 callers, random kills, give-ups and bad inputs, the scheduler killed twice",
         ctx do
      opts = [max_new_tokens: 24, scheduler_options: [prefix_cache_bytes: 0, slots: 8]]
      name = start_serving(ctx, opts)
      streaming = start_serving(ctx, opts ++ [stream: true])
      # Warm up both, then the baseline.
      Nx.Serving.batched_run(name, "Hello")
      Enum.to_list(Nx.Serving.batched_run(streaming, "Hello"))
      baseline = settled_active()

      :rand.seed(:exsss, {1, 2, 3})

      bad_inputs = [
        [],
        %{text: "x", regex: "(a"},
        %{input_ids: [-1]},
        %{text: String.duplicate("word ", 3000)},
        %{unknown: 1}
      ]

      plans =
        for i <- 1..64 do
          case :rand.uniform(10) do
            n when n <= 4 -> {:read, i}
            n when n <= 6 -> {:kill, i, :rand.uniform(300)}
            n when n <= 8 -> {:give_up, i, :rand.uniform(300)}
            _ -> {:bad, i, Enum.random(bad_inputs)}
          end
        end

      run = fn i, input ->
        if rem(i, 2) == 0,
          do: Nx.Serving.batched_run(name, input),
          else: streaming |> Nx.Serving.batched_run(input) |> Enum.join()
      end

      input = fn i -> Enum.at([@plain, "Hello", "Hi", "1, 2, 3,"], rem(i, 4)) end

      callers =
        for plan <- plans do
          task =
            Task.async(fn ->
              try do
                case plan do
                  {:read, i} ->
                    {:answered, run.(i, input.(i))}

                  {:bad, i, bad} ->
                    {:answered, run.(i, bad)}

                  # Waits a while in a process of its own, then gives up on it.
                  {:give_up, i, ms} ->
                    inner =
                      Task.async(fn ->
                        try do
                          run.(i, input.(i))
                        rescue
                          error -> error
                        end
                      end)

                    Task.yield(inner, ms) || Task.shutdown(inner, :brutal_kill)
                    {:answered, :gave_up}

                  {:kill, i, _ms} ->
                    run.(i, input.(i))
                end
              rescue
                error -> {:answered, error}
              end
            end)

          {plan, task}
        end

      # Two kills of each serving's scheduler while the callers run.
      for _ <- 1..2 do
        Process.sleep(150)
        old = schedulers(name) ++ schedulers(streaming)
        Enum.each(old, &Process.exit(&1, :kill))
        restarted(name, old)
        restarted(streaming, old)
      end

      for {{:kill, _i, ms}, task} <- callers do
        Process.sleep(div(ms, 8))
        Process.exit(task.pid, :kill)
      end

      live = for {plan, task} <- callers, elem(plan, 0) != :kill, do: task
      answers = Task.yield_many(live, 90_000)

      for {task, answer} <- answers do
        assert {:ok, {:answered, value}} = answer, "caller #{inspect(task.pid)} got no answer"

        assert match?(%{results: [_]}, value) or is_binary(value) or is_list(value) or
                 value == :gave_up or is_exception(value),
               inspect(value)
      end

      for {{:kill, _, _}, task} <- callers, do: Task.shutdown(task, :brutal_kill)

      # Bad inputs raised in their callers.
      plan_of = Map.new(callers, fn {plan, task} -> {task.ref, plan} end)

      for {task, {:ok, {:answered, value}}} <- answers,
          match?({:bad, _, _}, plan_of[task.ref]) do
        assert is_exception(value), inspect(value)
      end

      # Service goes on, and MLX's memory is back within 5% of the baseline.
      assert %{results: [%{num_tokens: 24}]} = Nx.Serving.batched_run(name, @plain)
      for pid <- schedulers(name) ++ schedulers(streaming), do: idle!(pid)
      after_chaos = await_active(round(baseline * 1.05), 10_000)
      assert after_chaos <= baseline * 1.05, "#{mb(baseline)} before, #{mb(after_chaos)} after"
    end

    defp idle!(scheduler) do
      wait_until(
        fn ->
          %{running: running, waiting: waiting} = EMLXAxon.Scheduler.occupancy(scheduler)
          running + waiting == 0
        end,
        10_000
      )
    end
  end
end
