defmodule EMLXAxon.SchedulerDownTest do
  # A scheduler that exits while requests wait on it: every waiting caller
  # (Scheduler.generate/3 and stream/3, TextGeneration.run/4 and stream/5
  # with :scheduler) gets an error within a second, wherever its request
  # was (prefill, decode, a constrained row, a stream), the scheduler's
  # supervisor restarts it and later requests are served. And a full queue
  # answers at once. Not async: it kills processes holding MLX work.
  use ExUnit.Case, async: false

  import EMLXAxon.TestCallers

  alias EMLXAxon.{Error, Scheduler, TestFixtures, TextGeneration}

  @moduletag :fixtures
  @moduletag timeout: 120_000

  @fixture "qwen3-4bit-g64"
  @long [max_new_tokens: 2000, ignore_eos: true]
  @schema %{"type" => "array", "items" => %{"type" => "integer"}}

  setup_all do
    %{state: TestFixtures.model(@fixture), tokenizer: TestFixtures.tokenizer(@fixture)}
  end

  # A named scheduler under the test's supervisor, which restarts it.
  defp start(ctx, opts) do
    name = :"scheduler_#{System.unique_integer([:positive])}"

    start_supervised!(
      {Scheduler,
       [model: ctx.state, tokenizer: ctx.tokenizer, name: name, prefix_cache_bytes: 0] ++ opts}
    )

    name
  end

  defp running(name), do: Scheduler.occupancy(name).running

  # A caller reading a long stream, telling `test` of every piece.
  defp streaming_caller(name, test) do
    caller(fn ->
      name
      |> Scheduler.stream("Hello", @long)
      |> Stream.each(fn _ -> send(test, :streamed) end)
      |> Stream.run()
    end)
  end

  # Kills the scheduler; every task must answer within a second, with the
  # scheduler's exit as an error. Then the restarted scheduler serves.
  defp kill_and_check(name, tasks) do
    pid = Process.whereis(name)
    Process.exit(pid, :kill)
    results = Task.yield_many(tasks, 1_000)

    for {task, result} <- results do
      assert {:ok, answer} = result, "a caller still waited a second after the kill"
      assert %Error{kind: :scheduler_down} = answer_error(answer), inspect(answer)
      Task.shutdown(task, :brutal_kill)
    end

    wait_until(fn -> Process.whereis(name) not in [nil, pid] end, 2_000)
    assert {:ok, %{num_tokens: 4}} = Scheduler.generate(name, "Hello", max_new_tokens: 4)
  end

  defp answer_error({:returned, {:error, error}}), do: error
  defp answer_error({:raised, error}), do: error
  defp answer_error(_other), do: :none

  test "killed mid-decode: every kind of caller gets an error within a second", ctx do
    name = start(ctx, slots: 4, steps_per_call: 2)
    test = self()

    tasks = [
      caller(fn -> Scheduler.generate(name, "Hello", @long) end),
      caller(fn ->
        name
        |> Scheduler.stream("Hi", @long)
        |> Stream.each(fn _ -> send(test, :streamed) end)
        |> Stream.run()
      end),
      caller(fn ->
        TextGeneration.run(ctx.tokenizer, ctx.state, "1, 2, 3,", [scheduler: name] ++ @long)
      end),
      caller(fn ->
        TextGeneration.stream(
          ctx.tokenizer,
          ctx.state,
          "Elixir is",
          fn _ -> send(test, :emitted) end,
          [scheduler: name] ++ @long
        )
      end)
    ]

    assert_receive :streamed, 30_000
    assert_receive :emitted, 30_000
    wait_until(fn -> running(name) == 4 end)
    kill_and_check(name, tasks)
  end

  test "killed mid-prefill: the caller gets an error within a second", ctx do
    # A long prompt prefilled 16 tokens between steps.
    name = start(ctx, slots: 2, prefill_chunk: 16, steps_per_call: 1)
    {:ok, ids} = EMLXAxon.Tokenizer.encode(ctx.tokenizer, String.duplicate("the sea ", 300))
    test = self()

    task =
      caller(fn ->
        send(test, :submitting)
        Scheduler.generate(name, ids, max_new_tokens: 4)
      end)

    assert_receive :submitting, 5_000
    wait_until(fn -> running(name) + Scheduler.occupancy(name).waiting == 1 end)
    kill_and_check(name, [task])
  end

  test "killed mid-constrained row: the caller gets an error within a second", ctx do
    name = start(ctx, slots: 2, steps_per_call: 1)
    test = self()

    task =
      caller(fn ->
        TextGeneration.stream(
          ctx.tokenizer,
          ctx.state,
          %{text: "Numbers:", json_schema: @schema},
          fn _ -> send(test, :emitted) end,
          scheduler: name,
          max_new_tokens: 2000
        )
      end)

    assert_receive :emitted, 30_000
    kill_and_check(name, [task])
  end

  test "killed mid-stream: the reader raises within a second", ctx do
    name = start(ctx, slots: 2, steps_per_call: 1)
    test = self()

    task = streaming_caller(name, test)

    assert_receive :streamed, 30_000
    kill_and_check(name, [task])
  end

  test "a scheduler that is not running is an error, not a wait", ctx do
    name = start(ctx, [])
    :ok = stop_supervised(name)

    assert {:error, %Error{kind: :scheduler_down}} = Scheduler.generate(name, "Hello")

    assert_raise Error, ~r/scheduler_down/, fn ->
      Enum.to_list(Scheduler.stream(name, "Hello"))
    end
  end

  test "a full queue answers at once", ctx do
    name = start(ctx, slots: 1, max_queue: 0, steps_per_call: 1)
    test = self()

    running = streaming_caller(name, test)

    assert_receive :streamed, 30_000
    started = System.monotonic_time(:millisecond)
    assert {:error, :overloaded} = Scheduler.generate(name, "Hi", max_new_tokens: 4)

    assert_raise Error, ~r/overloaded/, fn ->
      TextGeneration.run(ctx.tokenizer, ctx.state, "Hi", scheduler: name, max_new_tokens: 4)
    end

    assert System.monotonic_time(:millisecond) - started < 1_000
    Task.shutdown(running, :brutal_kill)
    wait_until(fn -> running(name) == 0 end, 5_000)
    assert {:ok, _} = Scheduler.generate(name, "Hi", max_new_tokens: 4)
  end
end
