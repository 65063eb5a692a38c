# Runs only where Nx is available (this repository builds without Hex, so
# these tests run in applications or CI setups that bring Nx).
#
# Each test runs on both kinds of serving: the default one, decoding
# through schedulers of its own (continuous batching), and a static one
# (`scheduler: false`), whose executions decode their batch to the end.
for mode <- [:continuous, :static], Code.ensure_loaded?(Nx.Serving) do
  defmodule Module.concat(EMLXAxon.TextGeneration.ServingTest, Macro.camelize("#{mode}")) do
    use ExUnit.Case, async: false

    alias EMLXAxon.{
      Error,
      Scheduler,
      TestFixtures,
      TestForeignTokenizers,
      TestJSON,
      TextGeneration
    }

    @moduletag :fixtures

    @plain "The quick brown fox jumps over the lazy dog."
    @chat [%{role: "user", content: "Give me a short introduction to large language models."}]
    @opts [max_new_tokens: 16]
    @mode mode
    @mode_opts if mode == :static, do: [scheduler: false], else: []

    setup_all do
      name = "qwen3-4bit-g64"
      %{tokenizer: TestFixtures.tokenizer(name), state: TestFixtures.model(name)}
    end

    # Results but for the left padding a row was given, which depends on
    # what it was batched with.
    defp results(outputs) when is_list(outputs), do: Enum.map(outputs, &results/1)

    defp results(output) do
      Enum.map(output.results, &update_in(&1.token_summary, fn s -> Map.delete(s, :padding) end))
    end

    defp ids(output), do: hd(output.results).token_ids

    defp token_ids(outputs) when is_list(outputs), do: Enum.flat_map(outputs, &token_ids/1)
    defp token_ids(output), do: Enum.map(output.results, & &1.token_ids)

    # A serving of this module's kind.
    defp serving(tokenizer, state, opts),
      do: TextGeneration.serving(tokenizer, state, opts ++ @mode_opts)

    test "Nx.Serving.run/2 gives run/4's results", %{tokenizer: tokenizer, state: state} do
      reference = TestFixtures.reference("qwen3-4bit-g64")["prompts"]
      plain_ids = reference["plain"]["greedy_ids"]

      for opts <- [
            @opts,
            [max_new_tokens: 24, stop: ["the"]],
            @opts ++ [eos_token_ids: [Enum.at(plain_ids, 3)]]
          ] do
        serving = serving(tokenizer, state, opts)

        for input <- [@plain, @chat, %{text: @plain}, [@plain, @chat, "Hello"]] do
          assert results(Nx.Serving.run(serving, input)) ==
                   results(TextGeneration.run(tokenizer, state, input, opts)),
                 "#{inspect(input)} with #{inspect(opts)}"
        end
      end

      assert %{results: [%{token_ids: ^plain_ids}], metadata: %{batch_size: 1, prompt_tokens: 10}} =
               Nx.Serving.run(serving(tokenizer, state, @opts), @plain)
    end

    test "a float16 KV cache (kv_dtype) gives run/4's float16 ids", %{
      tokenizer: tokenizer,
      state: state
    } do
      opts = [max_new_tokens: 12, ignore_eos: true, kv_dtype: :float16]
      serving = serving(tokenizer, state, opts)

      for input <- [@plain, [@plain, "Hello"]] do
        assert token_ids(Nx.Serving.run(serving, input)) ==
                 token_ids(TextGeneration.run(tokenizer, state, input, opts))
      end
    end

    test "from_mlx4bit/3", %{tokenizer: tokenizer, state: state} do
      path = TestFixtures.path("qwen3-4bit-g64")
      native = TestForeignTokenizers.native(Path.join(path, "tokenizer.json"))

      for given <- [nil, tokenizer, native, TestForeignTokenizers.bumblebee(native)] do
        # The fixture model's dtype (float32 on every device): on a GPU the
        # default is bfloat16, whose ids need not match float32's.
        serving =
          TextGeneration.from_mlx4bit(path, given, @opts ++ [dtype: :float32] ++ @mode_opts)

        for input <- [@plain, @chat] do
          assert results(Nx.Serving.run(serving, input)) ==
                   results(TextGeneration.run(tokenizer, state, input, @opts))
        end
      end
    end

    test "serving/3 takes Bumblebee's tokenizer, results have Bumblebee's keys", %{
      tokenizer: tokenizer,
      state: state
    } do
      path = Path.join(TestFixtures.path("qwen3-4bit-g64"), "tokenizer.json")
      bumblebee = path |> TestForeignTokenizers.native() |> TestForeignTokenizers.bumblebee()
      serving = serving(bumblebee, state, @opts)
      %{results: [expected]} = TextGeneration.run(tokenizer, state, @plain, @opts)

      assert %{results: [%{text: text, token_summary: summary}]} =
               Nx.Serving.run(serving, %{text: @plain})

      assert text == expected.generated_text
      assert summary == %{input: 10, output: 16, padding: 0}
    end

    test "each input's seed holds across callers merged into one batch", %{
      tokenizer: tokenizer,
      state: state
    } do
      opts = @opts ++ [sampler: :top_p_cpu, temperature: 1.5, top_p: 1.0]
      alone = ids(TextGeneration.run(tokenizer, state, %{text: @plain, seed: 7}, opts))
      serving = serving(tokenizer, state, opts)
      assert ids(Nx.Serving.run(serving, %{text: @plain, seed: 7})) == alone

      name = :"serving_#{System.unique_integer([:positive])}"

      start_supervised!(
        {Nx.Serving, serving: serving, name: name, batch_size: 4, batch_timeout: 200}
      )

      inputs = [%{text: @plain, seed: 7}, %{text: "Hello", seed: 1}, %{text: @plain, seed: 9}]

      [first, _, third] =
        inputs
        |> Enum.map(&Task.async(fn -> Nx.Serving.batched_run(name, &1) end))
        |> Task.await_many(60_000)

      # A static execution decoded the three together; through a scheduler,
      # each caller's metadata counts its own inputs.
      assert first.metadata.batch_size == if(@mode == :static, do: 3, else: 1)
      assert ids(first) == alone
      refute ids(third) == alone
    end

    test "inputs split over several executions report their own", %{
      tokenizer: tokenizer,
      state: state
    } do
      inputs = [@plain, "Hello", @chat, "1, 2, 3,", "Elixir is", "Hi"]
      # Through a scheduler, the caller submits its six inputs together
      # whatever executions routed them.
      sizes = if @mode == :static, do: [4, 4, 4, 4, 2, 2], else: List.duplicate(6, 6)
      split = tokenizer |> serving(state, @opts) |> Nx.Serving.batch_size(4)
      outputs = Nx.Serving.run(split, inputs)
      assert Enum.map(outputs, & &1.metadata.batch_size) == sizes

      # Bumblebee's way of setting the batch size.
      serving = serving(tokenizer, state, @opts ++ [compile: [batch_size: 4]])
      outputs = Nx.Serving.run(serving, inputs)
      assert Enum.map(outputs, & &1.metadata.batch_size) == sizes

      assert results(outputs) ==
               results(Enum.map(inputs, &TextGeneration.run(tokenizer, state, &1, @opts)))

      if @mode == :static do
        [_, _, _, _, fifth, sixth] = outputs
        assert fifth.metadata.prefill_ms == sixth.metadata.prefill_ms
        refute hd(outputs).metadata.prefill_ms == fifth.metadata.prefill_ms
      end
    end

    test "prompts of different length buckets are not batched together", %{
      tokenizer: tokenizer,
      state: state
    } do
      serving = serving(tokenizer, state, @opts ++ [compile: [sequence_length: [16, 64]]])

      name = :"serving_#{System.unique_integer([:positive])}"

      start_supervised!(
        {Nx.Serving, serving: serving, name: name, batch_size: 4, batch_timeout: 200}
      )

      # @plain has 10 tokens, the chat prompt more than 16.
      [short, long, short_too] =
        [@plain, @chat, "Hello"]
        |> Enum.map(&Task.async(fn -> Nx.Serving.batched_run(name, &1) end))
        |> Task.await_many(60_000)

      # Through a scheduler prompts of any length share the running batch.
      assert short.metadata.batch_size == if(@mode == :static, do: 2, else: 1)
      assert short_too.metadata.batch_size == if(@mode == :static, do: 2, else: 1)
      assert long.metadata.batch_size == 1
      assert results(long) == results(TextGeneration.run(tokenizer, state, @chat, @opts))
    end

    test "EMLXAxon.Stream.new/1 inside with_stream/2", %{tokenizer: tokenizer, state: state} do
      serving = serving(tokenizer, state, @opts)

      assert EMLXAxon.Stream.with_stream(EMLXAxon.Stream.new(:cpu), fn ->
               results(Nx.Serving.run(serving, @plain))
             end) == results(TextGeneration.run(tokenizer, state, @plain, @opts))
    end

    test "batched_run/2 batches concurrent callers", %{tokenizer: tokenizer, state: state} do
      serving = serving(tokenizer, state, @opts)
      name = :"serving_#{System.unique_integer([:positive])}"

      start_supervised!(
        {Nx.Serving, serving: serving, name: name, batch_size: 4, batch_timeout: 100}
      )

      inputs = [@plain, @chat, "Hello", "1, 2, 3,", "Elixir is", [@plain, "Hi"], @chat]
      expected = Enum.map(inputs, &results(TextGeneration.run(tokenizer, state, &1, @opts)))

      actual =
        inputs
        |> Enum.map(fn input ->
          Task.async(fn -> results(Nx.Serving.batched_run(name, input)) end)
        end)
        |> Task.await_many(60_000)

      assert actual == expected
    end

    test "partitions each get a stream", %{tokenizer: tokenizer, state: state} do
      serving = serving(tokenizer, state, @opts ++ [defn_options: [max_concurrency: 2]])

      name = :"serving_#{System.unique_integer([:positive])}"

      start_supervised!(
        {Nx.Serving,
         serving: serving, name: name, batch_size: 2, batch_timeout: 10, partitions: true}
      )

      inputs = [@plain, "Hello", @chat] |> List.duplicate(3) |> Enum.concat()
      expected = Enum.map(inputs, &results(TextGeneration.run(tokenizer, state, &1, @opts)))

      actual =
        inputs
        |> Enum.map(fn input ->
          Task.async(fn -> results(Nx.Serving.batched_run(name, input)) end)
        end)
        |> Task.await_many(60_000)

      assert actual == expected
    end

    test "a streaming serving yields text chunks", %{tokenizer: tokenizer, state: state} do
      for input <- [@plain, @chat] do
        %{results: [expected]} = TextGeneration.run(tokenizer, state, input, @opts)

        serving = serving(tokenizer, state, @opts ++ [stream: true])
        chunks = serving |> Nx.Serving.run(input) |> Enum.to_list()
        assert Enum.all?(chunks, &(is_binary(&1) and &1 != ""))
        assert IO.iodata_to_binary(chunks) == expected.generated_text

        serving = serving(tokenizer, state, @opts ++ [stream: true, stream_done: true])

        events = serving |> Nx.Serving.run(input) |> Enum.to_list()
        summary = expected.token_summary
        assert {:done, %{token_summary: ^summary, results: [^expected]}} = List.last(events)
        assert IO.iodata_to_binary(Enum.drop(events, -1)) == expected.generated_text
      end
    end

    test "a streaming serving process", %{tokenizer: tokenizer, state: state} do
      serving = serving(tokenizer, state, @opts ++ [stream: true])
      name = :"serving_#{System.unique_integer([:positive])}"

      start_supervised!(
        {Nx.Serving, serving: serving, name: name, batch_size: 2, batch_timeout: 50}
      )

      inputs = [@plain, "Hello", @chat]

      expected =
        Enum.map(
          inputs,
          &hd(TextGeneration.run(tokenizer, state, &1, @opts).results).generated_text
        )

      actual =
        inputs
        |> Enum.map(fn input ->
          Task.async(fn -> name |> Nx.Serving.batched_run(input) |> Enum.join() end)
        end)
        |> Task.await_many(60_000)

      assert actual == expected
    end

    @schema %{
      "type" => "object",
      "properties" => %{
        "name" => %{"type" => "string", "maxLength" => 8},
        "n" => %{"type" => "integer", "minimum" => 0, "maximum" => 9}
      },
      "required" => ["name", "n"],
      "additionalProperties" => false
    }
    @list_schema %{"type" => "array", "items" => %{"type" => "boolean"}, "maxItems" => 3}

    # The constrained inputs' outputs, checked against their constraint.
    defp assert_constrained(inputs, outputs) do
      for {input, %{results: [result]}} <- Enum.zip(inputs, outputs) do
        case input do
          %{json_schema: schema} ->
            assert result.finish_reason in [:stop, :eos], result.text
            value = TestJSON.decode!(result.text)

            if schema in [@schema, EMLXAxon.JSON.encode!(@schema)] do
              assert %{"name" => name, "n" => n} = value
              assert map_size(value) == 2 and String.length(name) <= 8 and n in 0..9
            else
              assert is_list(value) and length(value) <= 3 and Enum.all?(value, &is_boolean/1)
            end

          %{regex: _} ->
            assert result.text =~ ~r/\Aab+c\z/

          _free ->
            :ok
        end
      end
    end

    test "per-input constraints, free and constrained inputs together", %{
      tokenizer: tokenizer,
      state: state
    } do
      opts = [max_new_tokens: 60]

      inputs = [
        %{text: @plain, json_schema: @schema},
        "Hello",
        %{text: "A list:", json_schema: @list_schema, seed: 3},
        %{text: "Hi", regex: "ab+c"},
        %{messages: @chat, json_schema: EMLXAxon.JSON.encode!(@schema)}
      ]

      alone = Enum.map(inputs, &TextGeneration.run(tokenizer, state, &1, opts))
      serving = serving(tokenizer, state, opts)

      # One caller's list: constrained and free rows share the execution.
      listed = Nx.Serving.run(serving, inputs)
      assert results(listed) == results(alone)
      assert Enum.all?(listed, &(&1.metadata.batch_size == 5))
      assert_constrained(inputs, listed)

      # Callers merged by a serving process.
      name = :"serving_#{System.unique_integer([:positive])}"

      start_supervised!(
        {Nx.Serving, serving: serving, name: name, batch_size: 8, batch_timeout: 200}
      )

      merged =
        inputs
        |> Enum.map(&Task.async(fn -> Nx.Serving.batched_run(name, &1) end))
        |> Task.await_many(60_000)

      assert results(merged) == results(alone)
      assert_constrained(inputs, merged)
      # The constrained callers of one length bucket were decoded together;
      # the free one, and the longer chat prompt, apart.
      if @mode == :static do
        assert Enum.map(merged, & &1.metadata.batch_size) == [3, 1, 3, 3, 1]
      end

      # The serving's own constraint applies to the inputs without one.
      serving = serving(tokenizer, state, opts ++ [regex: "ab+c"])
      [free, own] = Nx.Serving.run(serving, ["Hello", %{text: "Hi", json_schema: @schema}])
      assert hd(free.results).text =~ ~r/\Aab+c\z/
      assert_constrained([%{json_schema: @schema}], [own])
    end

    test "a bad per-input constraint raises in its caller only", %{
      tokenizer: tokenizer,
      state: state
    } do
      serving = serving(tokenizer, state, @opts)
      name = :"serving_#{System.unique_integer([:positive])}"

      start_supervised!(
        {Nx.Serving, serving: serving, name: name, batch_size: 4, batch_timeout: 100}
      )

      good = Task.async(fn -> Nx.Serving.batched_run(name, ["Hello", @plain]) end)

      for {input, message} <- [
            {%{text: "x", regex: "(a"}, ~r/invalid regex/},
            {%{text: "x", json_schema: "{oops"}, ~r/not valid JSON/},
            {%{text: "x", grammar: "start: nothing_here"}, ~r/invalid grammar/},
            {%{text: "x", regex: "a", grammar: "start: \"a\""}, ~r/mutually exclusive/}
          ] do
        assert_raise ArgumentError, message, fn -> Nx.Serving.batched_run(name, input) end
        assert_raise ArgumentError, message, fn -> Nx.Serving.run(serving, [@plain, input]) end
      end

      assert results(Task.await(good, 60_000)) ==
               results(TextGeneration.run(tokenizer, state, ["Hello", @plain], @opts))

      assert_raise ArgumentError, ~r/invalid regex/, fn ->
        serving(tokenizer, state, regex: "(a")
      end
    end

    @tools [
      %{
        "type" => "function",
        "function" => %{
          "name" => "get_weather",
          "parameters" => %{
            "type" => "object",
            "properties" => %{"city" => %{"type" => "string", "minLength" => 1, "maxLength" => 8}},
            "required" => ["city"],
            "additionalProperties" => false
          }
        }
      }
    ]

    test "results carry the tool calls when tools are offered", %{
      tokenizer: tokenizer,
      state: state
    } do
      messages = [%{role: "user", content: "What is the weather in Paris?"}]
      grammar = EMLXAxon.ToolCalls.grammar(@tools, max_calls: 1)
      input = %{messages: messages, grammar: grammar}
      opts = [max_new_tokens: 120, tools: @tools]

      %{results: [expected]} = TextGeneration.run(tokenizer, state, input, opts)
      assert [_ | _] = calls = expected.tool_calls
      assert Enum.all?(calls, &match?(%{name: "get_weather", arguments: %{"city" => _}}, &1))
      assert expected.tool_call_errors == []

      serving = serving(tokenizer, state, opts)
      assert %{results: [^expected]} = Nx.Serving.run(serving, input)

      # A free input gets its (here: no) calls parsed too.
      [called, free] = Nx.Serving.run(serving, [input, messages])
      assert called.results == [expected]
      assert %{tool_calls: [], tool_call_errors: []} = hd(free.results)

      # Without tools, no tool keys.
      plain = serving(tokenizer, state, max_new_tokens: 80)
      refute Map.has_key?(hd(Nx.Serving.run(plain, input).results), :tool_calls)

      streaming = serving(tokenizer, state, opts ++ [stream: true, stream_done: true])

      events = streaming |> Nx.Serving.run(input) |> Enum.to_list()
      assert {:done, %{results: [^expected]}} = List.last(events)
      assert IO.iodata_to_binary(Enum.drop(events, -1)) == expected.text
    end

    # Schedulers started apart from the serving, shared by servings (the
    # serving's kind is then theirs).
    if @mode == :continuous do
      describe "with a scheduler" do
        setup %{tokenizer: tokenizer, state: state} do
          start = fn id ->
            start_supervised!(
              # Two steps a call: streams come in several pieces.
              {Scheduler,
               model: state,
               tokenizer: tokenizer,
               slots: 8,
               prefix_cache_bytes: 0,
               steps_per_call: 2},
              id: id
            )
          end

          %{scheduler: start.(:first), other: start.(:second)}
        end

        # What a direct run and a scheduled one agree on (padding and timings
        # differ by design).
        defp comparable(outputs) when is_list(outputs), do: Enum.map(outputs, &comparable/1)

        defp comparable(%{results: [result]}) do
          result
          |> Map.drop([:token_summary])
          |> Map.put(:input, result.token_summary.input)
        end

        # The scheduler drops a request of a caller that went away at its next
        # step: wait for it (some seconds at most).
        defp idle?(scheduler, tries \\ 100) do
          case Scheduler.occupancy(scheduler) do
            %{running: 0, waiting: 0} ->
              true

            _ when tries > 0 ->
              Process.sleep(50)
              idle?(scheduler, tries - 1)

            _ ->
              false
          end
        end

        defp start_serving(serving, opts \\ []) do
          name = :"serving_#{System.unique_integer([:positive])}"

          start_supervised!(
            {Nx.Serving, [serving: serving, name: name, batch_size: 4, batch_timeout: 20] ++ opts}
          )

          name
        end

        test "gives run/4's outputs, locally and through distributed batched_run", ctx do
          %{tokenizer: tokenizer, state: state, scheduler: scheduler} = ctx
          inputs = [@plain, @chat, "Hello", [@plain, "Hi"], %{text: "1, 2, 3,", seed: 4}]
          expected = Enum.map(inputs, &TextGeneration.run(tokenizer, state, &1, @opts))
          serving = TextGeneration.serving(tokenizer, state, @opts ++ [scheduler: scheduler])

          assert comparable(Enum.map(inputs, &Nx.Serving.run(serving, &1))) ==
                   comparable(expected)

          assert %{metadata: %{batch_size: 2}, results: [%{token_summary: %{padding: 0}}]} =
                   hd(Nx.Serving.run(serving, [@plain, @chat]))

          name = start_serving(serving)

          for call <- [name, {:local, name}, {:distributed, name}] do
            actual =
              inputs
              |> Enum.map(&Task.async(fn -> Nx.Serving.batched_run(call, &1) end))
              |> Task.await_many(60_000)

            assert comparable(actual) == comparable(expected), inspect(call)
          end

          assert idle?(scheduler)
        end

        test "partitions map to schedulers", ctx do
          %{tokenizer: tokenizer, state: state, scheduler: first, other: second} = ctx
          inputs = [@plain, @chat, "Hello", "Hi"] |> List.duplicate(3) |> Enum.concat()
          expected = Enum.map(inputs, &TextGeneration.run(tokenizer, state, &1, @opts))

          serving =
            TextGeneration.serving(
              tokenizer,
              state,
              @opts ++ [scheduler: [first, second], defn_options: [max_concurrency: 2]]
            )

          name = start_serving(serving, partitions: true)

          actual =
            inputs
            |> Enum.map(&Task.async(fn -> Nx.Serving.batched_run(name, &1) end))
            |> Task.await_many(60_000)

          assert comparable(actual) == comparable(expected)
          alias TextGeneration.Serving.Scheduled

          assert Enum.map(0..3, &Scheduled.scheduler([first, second], &1)) == [
                   first,
                   second,
                   first,
                   second
                 ]
        end

        test "streams text as it arrives, locally and through distributed batched_run", ctx do
          %{tokenizer: tokenizer, state: state, scheduler: scheduler} = ctx
          opts = @opts ++ [scheduler: scheduler, stream: true]

          for input <- [@plain, @chat] do
            %{results: [expected]} = TextGeneration.run(tokenizer, state, input, @opts)
            serving = TextGeneration.serving(tokenizer, state, opts)
            chunks = serving |> Nx.Serving.run(input) |> Enum.to_list()
            assert length(chunks) >= 2 and Enum.all?(chunks, &(is_binary(&1) and &1 != ""))
            assert IO.iodata_to_binary(chunks) == expected.generated_text

            serving = TextGeneration.serving(tokenizer, state, opts ++ [stream_done: true])
            name = start_serving(serving)

            for call <- [name, {:distributed, name}] do
              events = call |> Nx.Serving.batched_run(input) |> Enum.to_list()
              assert {:done, %{token_summary: summary, results: [result]}} = List.last(events)
              assert comparable(%{results: [result]}) == comparable(%{results: [expected]})
              assert summary == %{input: expected.token_summary.input, output: 16, padding: 0}
              assert IO.iodata_to_binary(Enum.drop(events, -1)) == expected.generated_text
            end
          end

          # Reading part of the stream cancels the rest of the request.
          long =
            TextGeneration.serving(
              tokenizer,
              state,
              opts ++ [max_new_tokens: 2000, ignore_eos: true]
            )

          assert [_] = long |> Nx.Serving.run(@plain) |> Enum.take(1)
          assert idle?(scheduler)

          assert_raise ArgumentError, ~r/one input at a time/, fn ->
            Nx.Serving.run(TextGeneration.serving(tokenizer, state, opts), ["a", "b"])
          end
        end

        test "a request sent while a long batch decodes is not held back by it", ctx do
          %{tokenizer: tokenizer, state: state, scheduler: scheduler} = ctx
          long = [max_new_tokens: 400, ignore_eos: true, stream: true]

          # Four callers merged into one long batch, then one more caller
          # while that batch decodes: when does its first token come, and
          # when does the long batch end?
          race = fn serving ->
            name = start_serving(serving)
            test = self()
            ref = make_ref()

            batch =
              for input <- [@plain, "Hello", "Hi", "1, 2, 3,"] do
                Task.async(fn ->
                  name
                  |> Nx.Serving.batched_run(input)
                  |> Stream.each(fn _ -> send(test, {ref, :decoding}) end)
                  |> Stream.run()

                  System.monotonic_time(:millisecond)
                end)
              end

            assert_receive {^ref, :decoding}, 60_000
            sent = System.monotonic_time(:millisecond)

            late =
              Task.async(fn ->
                [_] = name |> Nx.Serving.batched_run("Late") |> Enum.take(1)
                System.monotonic_time(:millisecond)
              end)

            first_token = Task.await(late, 120_000)
            batch_end = batch |> Task.await_many(120_000) |> Enum.max()
            {first_token - sent, batch_end - sent}
          end

          {first, batch_left} =
            race.(TextGeneration.serving(tokenizer, state, long ++ [scheduler: scheduler]))

          assert first * 4 < batch_left,
                 "first token after #{first} ms, the batch ended #{batch_left} ms after the request"

          # The default serving, through schedulers of its own, neither.
          {first, batch_left} = race.(TextGeneration.serving(tokenizer, state, long))

          assert first * 4 < batch_left,
                 "first token after #{first} ms, the batch ended #{batch_left} ms after the request"

          # A static serving: the request waits for the running execution.
          {first, batch_left} =
            race.(TextGeneration.serving(tokenizer, state, long ++ [scheduler: false]))

          assert first * 2 > batch_left,
                 "first token after #{first} ms, the batch ended #{batch_left} ms after the request"
        end

        test "per-input constraints and tool calls", ctx do
          %{tokenizer: tokenizer, state: state, scheduler: scheduler} = ctx
          messages = [%{role: "user", content: "What is the weather in Paris?"}]

          called = %{
            messages: messages,
            grammar: EMLXAxon.ToolCalls.grammar(@tools, max_calls: 1)
          }

          inputs = [called, %{text: @plain, json_schema: @schema}, "Hello"]
          opts = [max_new_tokens: 120, tools: @tools]
          expected = TextGeneration.run(tokenizer, state, inputs, opts)
          serving = TextGeneration.serving(tokenizer, state, opts ++ [scheduler: scheduler])
          actual = Nx.Serving.run(serving, inputs)
          assert comparable(actual) == comparable(expected)
          assert [_ | _] = hd(hd(actual).results).tool_calls
          assert_constrained(inputs, actual)
        end

        test "errors", %{tokenizer: tokenizer, state: state, scheduler: scheduler} do
          assert_raise ArgumentError, ~r/cannot be used with :scheduler/, fn ->
            TextGeneration.serving(tokenizer, state,
              scheduler: scheduler,
              stream: EMLXAxon.Stream.new(:cpu)
            )
          end

          assert_raise ArgumentError,
                       ~r/expected :scheduler to be a boolean, the pid or name/,
                       fn ->
                         TextGeneration.serving(tokenizer, state, scheduler: [])
                       end

          serving = TextGeneration.serving(tokenizer, state, @opts ++ [scheduler: scheduler])

          assert_raise ArgumentError, ~r/invalid regex/, fn ->
            Nx.Serving.run(serving, %{text: "x", regex: "(a"})
          end

          other = TestFixtures.model("qwen3-4bit-g128")
          serving = TextGeneration.serving(tokenizer, other, @opts ++ [scheduler: scheduler])

          assert_raise ArgumentError, ~r/serves a different model/, fn ->
            Nx.Serving.run(serving, @plain)
          end
        end
      end
    end

    test "errors", %{tokenizer: tokenizer, state: state} do
      streaming = serving(tokenizer, state, stream: true)

      assert_raise ArgumentError, ~r/one input at a time/, fn ->
        Nx.Serving.run(streaming, ["a", "b"])
      end

      serving = serving(tokenizer, state, max_len: 5)
      assert_raise Error, ~r/prompt_too_long/, fn -> Nx.Serving.run(serving, @plain) end
      assert_raise ArgumentError, ~r/empty list/, fn -> Nx.Serving.run(serving, []) end
    end
  end
end

defmodule EMLXAxon.TextGeneration.ServingLogicTest do
  # The serving's own logic lives in plain modules that need no Nx (the
  # Nx.Serving callbacks only move their binaries in and out of tensors),
  # so it is tested everywhere.
  use ExUnit.Case, async: true

  alias EMLXAxon.{Error, TestFixtures, TextGeneration}
  alias EMLXAxon.TextGeneration.{Config, Input, Output}
  alias EMLXAxon.TextGeneration.Serving.{Batch, Constraints, Events, Execution, Results}

  @plain "The quick brown fox jumps over the lazy dog."
  @chat [%{role: "user", content: "Give me a short introduction to large language models."}]

  defp request(n, seed \\ nil, constraint \\ nil),
    do: %{ids: Enum.to_list(1..n), seed: seed, constraint: constraint}

  describe "batching inputs" do
    test "prompts are padded to a length bucket, not to :max_len" do
      opts = Config.serving!(max_len: 32_768)
      assert Batch.buckets(opts) == Enum.map(4..15, &Integer.pow(2, &1))

      for {length, width} <- [{1, 16}, {10, 16}, {16, 16}, {17, 32}, {20_000, 32_768}] do
        assert Batch.width!([request(length)], opts) == width
      end

      assert Batch.width!([request(3), request(40), request(7)], opts) == 64

      %{input_ids: ids} = Batch.encode([request(10), request(12)], 16)
      assert byte_size(ids) == 2 * 16 * 4

      assert Batch.buckets(Config.serving!(max_len: 100)) == [16, 32, 64, 100]
      assert Batch.buckets(Config.serving!(max_len: 8)) == [8]

      keys = Batch.batch_keys(Config.serving!(max_len: 100))
      plain = Enum.map([16, 32, 64, 100], &{:sequence_length, &1})
      assert Enum.take(keys, 4) == plain
      assert {:sequence_length, 16, :constraint_bytes, 256} in keys
      assert {:sequence_length, 100, :constraint_bytes, 4 * 1024 * 1024} in keys
      assert length(keys) == 4 + 4 * 8
    end

    test "compile: [sequence_length: ...] sets the buckets" do
      opts = Config.serving!(compile: [batch_size: 4, sequence_length: [64, 32]])
      assert Batch.buckets(opts) == [32, 64]
      assert Batch.width!([request(20)], opts) == 32
      assert Batch.width!([request(33)], opts) == 64

      assert_raise Error, ~r/longest compiled sequence_length \(64\)/, fn ->
        Batch.width!([request(65)], opts)
      end

      assert Batch.buckets(Config.serving!(compile: [sequence_length: 128])) == [128]
    end

    test "a prompt must leave room to generate" do
      opts = Config.serving!(max_len: 10)

      assert_raise Error, ~r/prompt_too_long.*max_len is 10/, fn ->
        Batch.width!([request(10)], opts)
      end
    end

    test "requests survive the trip, merged with other callers' and padded" do
      first = [request(3, 7), request(16)]
      second = [%{ids: [5, 151_643, 0], seed: 0, constraint: nil}]
      a = Batch.encode(first, 16)
      b = Batch.encode(second, 16)

      # Nx.Serving concatenates callers' batches row-wise, and may pad them.
      pad = Batch.encode([request(1)], 16)
      merged = Map.new(a, fn {key, value} -> {key, value <> b[key] <> pad[key]} end)

      assert Batch.decode(merged, 16, 3) == first ++ second
    end

    test "per-input constraints survive the trip, beside free inputs" do
      schema = ~s({"type": "object", "properties": {"é": {"type": "string"}}})
      first = [request(3, 7, {:json_schema, schema}), request(5), request(2, nil, {:regex, "a+"})]
      second = [request(4, 1, {:grammar, "start: \"x\""}), request(6)]

      # One bucket for all of a caller's rows: the longest constraint's.
      assert Batch.key(first, 16) == {:sequence_length, 16, :constraint_bytes, 256}
      assert Batch.key([request(3)], 16) == {:sequence_length, 16}
      big = request(3, nil, {:regex, String.duplicate("a", 300)})
      assert Batch.key([request(2), big], 32) == {:sequence_length, 32, :constraint_bytes, 1024}

      # No constraint, no constraint fields: free callers batch as before.
      assert Map.keys(Batch.encode([request(3)], 16)) == [:input_ids, :length, :seed]

      a = Batch.encode(first, 16)
      b = Batch.encode(second, 16)
      assert byte_size(a.constraint) == 3 * 256
      # Nx.Serving pads a batch with zero rows: a request of nothing.
      pad =
        Map.new(a, fn {key, value} -> {key, :binary.copy(<<0>>, div(byte_size(value), 3))} end)

      merged = Map.new(a, fn {key, value} -> {key, value <> b[key] <> pad[key]} end)

      assert Batch.decode(merged, 16, 5) == first ++ second
      assert [_, _, _, _, _, %{ids: [], seed: 0, constraint: nil}] = Batch.decode(merged, 16, 6)
    end

    test "a constraint longer than the largest bucket is refused" do
      huge = request(3, nil, {:regex, String.duplicate("a", 4 * 1024 * 1024 + 1)})

      assert_raise ArgumentError, ~r/at most 4194304 bytes per input/, fn ->
        Batch.key([huge], 16)
      end
    end

    test "the client's padding costs time in proportion to the prompt, not to :max_len" do
      requests = [request(10)]

      # The best of 5 rounds: one round can take a collection or a busy
      # machine's pause and read slower than it is.
      time = fn max_len ->
        Enum.min(
          for _ <- 1..5 do
            {us, _} = :timer.tc(fn -> for _ <- 1..200, do: Batch.encode(requests, max_len) end)
            us
          end
        )
      end

      # Padding to the bucket instead of :max_len is what makes it cheap.
      assert time.(16) * 10 < time.(32_768)
    end
  end

  describe "splitting outputs" do
    defp rows(n, offset) do
      for i <- 1..n do
        %{ids: Enum.to_list((offset + i)..(offset + 2 * i)), text: "", finish_reason: :length}
      end
    end

    defp stats(prompt_tokens, ms) do
      %{
        prompt_tokens: prompt_tokens,
        generated_tokens: [],
        prefill_ms: ms,
        decode_ms: ms + 1,
        decode_tokens_per_s: ms + 2,
        time_to_first_token_ms: ms + 3,
        total_ms: ms + 4
      }
    end

    # What Nx.Serving does with a caller's rows: slices each field per row,
    # and concatenates the slices of several executions.
    defp slice(fields, start, count) do
      Map.new(fields, fn {name, {_type, shape, binary}} ->
        row = div(byte_size(binary), elem(shape, 0))
        {name, binary_part(binary, start * row, count * row)}
      end)
    end

    test "rows carry their own execution's metadata" do
      first = Results.encode(rows(4, 0), stats([3, 5, 4, 2], 10.0), 8)
      second = Results.encode(rows(2, 10), stats([6, 1], 20.0), 8)

      # A caller of six inputs split over two executions of 4 and 2.
      caller = Map.merge(slice(first, 0, 4), slice(second, 0, 2), fn _name, a, b -> a <> b end)

      decoded = Results.decode(caller, 8)
      assert Enum.map(decoded, & &1.metadata.batch_size) == [4, 4, 4, 4, 2, 2]
      assert Enum.map(decoded, & &1.metadata.prefill_ms) == [10.0, 10.0, 10.0, 10.0, 20.0, 20.0]
      assert Enum.map(decoded, & &1.metadata.total_ms) == [14.0, 14.0, 14.0, 14.0, 24.0, 24.0]
      assert Enum.map(decoded, & &1.prompt_tokens) == [3, 5, 4, 2, 6, 1]
      assert Enum.map(decoded, & &1.padding) == [2, 0, 1, 3, 0, 5]
      assert Enum.map(decoded, & &1.ids) == Enum.map(rows(4, 0) ++ rows(2, 10), & &1.ids)

      # A caller whose rows sit in the middle of an execution.
      [row] = Results.decode(slice(first, 2, 1), 8)

      # No forced tokens, engine paths nor KV dtype in these stats.
      assert row.metadata == %{
               prompt_tokens: 4,
               generated_tokens: 4,
               forced_tokens: 0,
               batch_size: 4,
               prefill_ms: 10.0,
               decode_ms: 11.0,
               decode_tokens_per_s: 12.0,
               time_to_first_token_ms: 13.0,
               total_ms: 14.0,
               decode_path: nil,
               prefill_path: nil,
               fallbacks: nil,
               kv_dtype: nil
             }
    end

    test "every finish reason survives the trip" do
      reasons = [:eos, :stop, :length, :max_len, :timeout]
      rows = Enum.map(reasons, &%{ids: [1], text: "", finish_reason: &1})
      fields = Results.encode(rows, stats([1, 1, 1, 1, 1], 1.0), 4)
      decoded = Results.decode(slice(fields, 0, 5), 4)
      assert Enum.map(decoded, & &1.finish_reason) == reasons
    end
  end

  describe "streaming events" do
    test "chunks of text per row" do
      rows = [%{text: "héllo"}, %{text: ""}, %{text: "a"}]
      {matrix, {3, width}, sizes} = Events.encode_chunk(rows)
      assert width == byte_size("héllo")
      sizes = for <<size::signed-native-32 <- sizes>>, do: size

      items =
        for {size, row} <- Enum.with_index(sizes) do
          Events.items({:chunk, binary_part(matrix, row * width, width), size}, true)
        end

      assert items == [["héllo"], [], ["a"]]
      assert {_, {1, 1}, _} = Events.encode_chunk([%{text: ""}])
    end

    test "the final event has Bumblebee's shape and EMLXAxon's output" do
      output =
        Output.build(
          %{ids: [1, 2], text: "ab", finish_reason: :length, prompt_tokens: 5, padding: 0},
          %{batch_size: 1}
        )

      summary = %{input: 5, output: 2, padding: 0}

      assert [{:done, %{token_summary: ^summary, results: [%{text: "ab"}], metadata: %{}}}] =
               Events.items({:done, output}, true)

      assert Events.items({:done, output}, false) == []
    end
  end

  describe "tool calls" do
    test "a result gets its parsed calls only when tools were offered" do
      text = ~s(<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call><tool_call>{")

      output =
        Output.build(
          %{ids: [1], text: text, finish_reason: :length, prompt_tokens: 1, padding: 0},
          %{}
        )

      assert Output.put_tool_calls(output, nil) == output

      assert %{results: [%{tool_calls: [%{name: "add", arguments: %{"a" => 1}}]} = result]} =
               Output.put_tool_calls(output, [%{"type" => "function"}])

      assert [error] = result.tool_call_errors
      assert error =~ "never closed"
    end
  end

  describe "checking constraints" do
    @describetag :fixtures

    setup do
      name = "qwen3-4bit-g64"
      %{tokenizer: TestFixtures.tokenizer(name), state: TestFixtures.model(name)}
    end

    test "the engine's refusals are ArgumentErrors", %{tokenizer: tokenizer} do
      good = [
        %{constraint: {:json_schema, ~s({"type": "object"})}},
        %{constraint: nil},
        %{constraint: {:regex, "ab+c"}},
        %{constraint: {:grammar, "start: \"x\""}}
      ]

      assert Constraints.check!(tokenizer, good) == :ok

      for {constraint, message} <- [
            {{:json_schema, "{oops"}, ~r/not valid JSON/},
            {{:regex, "(a"}, ~r/invalid regex/},
            {{:grammar, "start: nothing_here"}, ~r/invalid grammar/},
            {{:json_schema, ~s({"dependentSchemas": {"a": {}}})}, ~r/dependentSchemas/}
          ] do
        assert_raise ArgumentError, message, fn ->
          Constraints.check!(tokenizer, good ++ [%{constraint: constraint}])
        end
      end
    end
  end

  describe "a serving over a scheduler" do
    @describetag :fixtures

    alias EMLXAxon.Scheduler
    alias EMLXAxon.TextGeneration.Serving.Scheduled

    setup do
      name = "qwen3-4bit-g64"
      tokenizer = TestFixtures.tokenizer(name)
      state = TestFixtures.model(name)

      scheduler =
        start_supervised!(
          # Two steps a call: streams come in several pieces.
          {Scheduler,
           model: state, tokenizer: tokenizer, slots: 4, prefix_cache_bytes: 0, steps_per_call: 2}
        )

      %{tokenizer: tokenizer, state: state, scheduler: scheduler}
    end

    defp request!(tokenizer, state, input, opts) do
      {[request], false} = Input.requests!(tokenizer, state, input, opts)
      request
    end

    test "partitions take the schedulers in turn" do
      assert Enum.map(0..4, &Scheduled.scheduler([:a, :b], &1)) == [:a, :b, :a, :b, :a]
      assert Scheduled.scheduler(:a, 3) == :a
      assert Config.serving!(scheduler: [:a, {:global, :b}]).scheduler == [:a, {:global, :b}]

      for bad <- [[], "llm", [:a, 1]] do
        assert_raise ArgumentError,
                     ~r/expected :scheduler to be a boolean, the pid or name/,
                     fn ->
                       Config.serving!(scheduler: bad)
                     end
      end

      assert_raise ArgumentError, ~r/cannot be used with :scheduler/, fn ->
        Config.serving!(scheduler: :a, mlx_stream: EMLXAxon.Stream.new(:cpu), stream: true)
      end
    end

    test "a caller's requests give run/4's outputs, with tool calls", ctx do
      %{tokenizer: tokenizer, state: state, scheduler: scheduler} = ctx
      digit = %{"type" => "integer", "minimum" => 0, "maximum" => 9}

      parameters = %{
        "type" => "object",
        "properties" => %{"x" => digit},
        "required" => ["x"],
        "additionalProperties" => false
      }

      tools = [
        %{"type" => "function", "function" => %{"name" => "f", "parameters" => parameters}}
      ]

      grammar = EMLXAxon.ToolCalls.grammar(tools, max_calls: 1)
      inputs = [@plain, %{messages: @chat, grammar: grammar}]
      run_opts = [max_new_tokens: 80, tools: tools, scheduler: scheduler]
      opts = Config.serving!(run_opts)
      {requests, true} = Input.requests!(tokenizer, state, inputs, opts)
      expected = TextGeneration.run(tokenizer, state, inputs, run_opts)
      outputs = Scheduled.run!(scheduler, state, requests, opts)
      assert Enum.map(outputs, & &1.results) == Enum.map(expected, & &1.results)
      assert [%{name: "f", arguments: %{"x" => x}}] = hd(List.last(outputs).results).tool_calls
      assert x in 0..9
    end

    test "a stream submits when read, gives the text as it comes, then the output", ctx do
      %{tokenizer: tokenizer, state: state, scheduler: scheduler} = ctx
      opts = Config.serving!(max_new_tokens: 24, stream: true, stream_done: true)
      request = request!(tokenizer, state, @plain, opts)
      %{results: [expected]} = TextGeneration.run(tokenizer, state, @plain, max_new_tokens: 24)

      stream = Scheduled.stream(scheduler, state, request, opts)
      assert %{running: 0, waiting: 0} = Scheduler.occupancy(scheduler)
      events = Enum.to_list(stream)
      {pieces, [{:done, output}]} = Enum.split(events, -1)
      assert length(pieces) >= 2 and Enum.all?(pieces, &(is_binary(&1) and &1 != ""))
      assert IO.iodata_to_binary(pieces) == expected.text
      assert hd(output.results).token_ids == expected.token_ids
      assert output.token_summary == %{input: 10, output: 24, padding: 0}

      # Without :stream_done, text only.
      opts = %{opts | stream_done: false}
      assert Enum.join(Scheduled.stream(scheduler, state, request, opts)) == expected.text
    end

    test "halting a stream early cancels its request; errors raise in the reader", ctx do
      %{tokenizer: tokenizer, state: state, scheduler: scheduler} = ctx
      opts = Config.serving!(max_new_tokens: 2000, ignore_eos: true, stream: true)
      request = request!(tokenizer, state, @plain, opts)
      assert [_, _] = scheduler |> Scheduled.stream(state, request, opts) |> Enum.take(2)

      assert Enum.any?(1..100, fn _ ->
               Process.sleep(20)
               match?(%{running: 0, waiting: 0}, Scheduler.occupancy(scheduler))
             end)

      bad = Map.put(request, :constraint, {:regex, "(a"})

      assert_raise ArgumentError, ~r/invalid regex/, fn ->
        scheduler |> Scheduled.stream(state, bad, opts) |> Enum.to_list()
      end

      other = TestFixtures.model("qwen3-4bit-g128")

      assert_raise ArgumentError, ~r/different model/, fn ->
        scheduler |> Scheduled.stream(other, request, opts) |> Enum.to_list()
      end
    end
  end

  describe "an execution" do
    @describetag :fixtures

    setup do
      name = "qwen3-4bit-g64"
      %{tokenizer: TestFixtures.tokenizer(name), state: TestFixtures.model(name)}
    end

    # The serving's whole path but for the tensors: requests encoded by the
    # client, an execution, its results split and decoded by the client.
    defp serve(tokenizer, state, inputs, opts) do
      opts = Config.serving!(opts)
      {requests, true} = Input.requests!(tokenizer, state, inputs, opts)
      width = Batch.width!(requests, opts)
      requests = requests |> Batch.encode(width) |> Batch.decode(width, length(requests))
      arg = %{tokenizer: tokenizer, state: state, opts: opts}
      fields = Execution.run(arg, requests, nil, nil)

      fields
      |> Map.new(fn {name, {_type, _shape, binary}} -> {name, binary} end)
      |> Results.decode(opts.max_new_tokens)
      |> Enum.map(fn row ->
        text = Output.text!(tokenizer, row.ids, row.finish_reason, opts.stop)
        Output.build(Map.put(row, :text, text), row.metadata)
      end)
    end

    test "gives run/4's outputs", %{tokenizer: tokenizer, state: state} do
      reference = TestFixtures.reference("qwen3-4bit-g64")["prompts"]
      greedy = reference["plain"]["greedy_ids"]
      {_k, _prefix, stop} = TestFixtures.stop_string(tokenizer, greedy)
      eos = Enum.at(greedy, 4)
      inputs = [@plain, @chat, "Hello", %{input_ids: [9707, 1879]}]

      for opts <- [
            [max_new_tokens: 16],
            [max_new_tokens: 16, stop: [stop]],
            [max_new_tokens: 16, eos_token_ids: [eos]],
            [max_new_tokens: 40]
          ] do
        expected = TextGeneration.run(tokenizer, state, inputs, opts)
        actual = serve(tokenizer, state, inputs, opts)
        assert Enum.map(actual, & &1.results) == Enum.map(expected, & &1.results), inspect(opts)

        for {a, e} <- Enum.zip(actual, expected) do
          assert Map.take(a.metadata, [:prompt_tokens, :generated_tokens, :batch_size]) ==
                   Map.take(e.metadata, [:prompt_tokens, :generated_tokens, :batch_size])
        end
      end
    end

    test "honours each input's constraint", %{tokenizer: tokenizer, state: state} do
      opts = [max_new_tokens: 40]
      schema = ~s({"type": "array", "items": {"type": "integer"}, "maxItems": 3})

      inputs = [
        %{text: @plain, json_schema: schema},
        "Hello",
        %{text: "Hi", regex: "ab+c"},
        %{text: "x", grammar: ~s(start: "yes" | "no")}
      ]

      expected = TextGeneration.run(tokenizer, state, inputs, opts)
      actual = serve(tokenizer, state, inputs, opts)
      assert Enum.map(actual, & &1.results) == Enum.map(expected, & &1.results)
      [json, _free, regex, grammar] = Enum.map(actual, &hd(&1.results).text)
      assert json =~ ~r/\A\[(-?\d+(, -?\d+){0,2})?\]\z/
      assert regex =~ ~r/\Aab+c\z/
      assert grammar in ["yes", "no"]
    end

    test "honours each input's seed", %{tokenizer: tokenizer, state: state} do
      opts = [max_new_tokens: 16, sampler: :top_p_cpu, temperature: 1.5, top_p: 1.0]
      inputs = [%{text: @plain, seed: 7}, %{text: "Hello", seed: 3}]
      expected = TextGeneration.run(tokenizer, state, inputs, opts)

      assert Enum.map(serve(tokenizer, state, inputs, opts), & &1.results) ==
               Enum.map(expected, & &1.results)

      [alone] = serve(tokenizer, state, [%{text: @plain, seed: 7}], opts)
      assert hd(alone.results).token_ids == hd(hd(expected).results).token_ids
    end
  end
end
