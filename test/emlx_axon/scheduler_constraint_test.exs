defmodule EMLXAxon.SchedulerConstraintTest do
  # Constrained requests through an EMLXAxon.Scheduler: JSON Schema, regex
  # and grammar outputs are valid, free requests are unchanged, bad
  # constraints raise before anything is queued, and run/4 / stream/5 with
  # :scheduler honour options-level and per-input constraints and tools.
  use ExUnit.Case, async: false

  alias EMLXAxon.{Scheduler, TestFixtures, TextGeneration, ToolCalls}
  alias EMLXAxon.JSON.Decoder

  import EMLXAxon.TestSchema, only: [valid?: 2]

  @moduletag :fixtures
  @moduletag timeout: 300_000

  @fixture "qwen3-4bit-g64"
  @prompt "Answer in JSON:"

  @schema %{
    "type" => "object",
    "properties" => %{
      "name" => %{"type" => "string", "maxLength" => 10},
      "home" => %{
        "type" => "object",
        "properties" => %{
          "city" => %{"type" => "string", "minLength" => 1, "maxLength" => 8},
          "floor" => %{"type" => "integer", "minimum" => 0, "maximum" => 40}
        },
        "required" => ["city", "floor"],
        "additionalProperties" => false
      },
      "tags" => %{
        "type" => "array",
        "items" => %{"enum" => ["red", "green", "blue"]},
        "minItems" => 1,
        "maxItems" => 3
      },
      "level" => %{"enum" => ["low", "high", 3]}
    },
    "required" => ["name", "home", "tags", "level"],
    "additionalProperties" => false
  }

  @regex "[0-9]{3}-[a-z]{2,4}"

  setup_all do
    %{tokenizer: TestFixtures.tokenizer(@fixture), state: TestFixtures.model(@fixture)}
  end

  setup ctx do
    server =
      start_supervised!(
        {Scheduler, model: ctx.state, tokenizer: ctx.tokenizer, slots: 4, prefix_cache_bytes: 0}
      )

    %{server: server}
  end

  defp assert_valid_json(text, schema) do
    assert {:ok, value} = Decoder.decode(text), "not JSON: #{inspect(text)}"
    assert valid?(value, schema), "#{text} breaks #{inspect(schema)}"
  end

  describe "Scheduler.generate/3" do
    test "JSON Schema, regex and grammar outputs are valid, sampled or greedy", ctx do
      server = ctx.server
      schema_text = EMLXAxon.JSON.encode!(@schema)

      json_runs =
        for seed <- 1..6 do
          schema = if rem(seed, 2) == 0, do: @schema, else: schema_text
          opts = [json_schema: schema, max_new_tokens: 200]

          opts =
            if seed > 1,
              do: opts ++ [sampler: :top_p_gpu, temperature: 1.0, seed: seed],
              else: opts

          Task.async(fn -> Scheduler.generate(server, @prompt, opts) end)
        end

      regex_run =
        Task.async(fn ->
          Scheduler.generate(server, "A code:", regex: @regex, sampler: :top_p_cpu, seed: 5)
        end)

      grammar = ~S"""
      start: greeting " " number ("," number)*
      greeting: "hello" | "bye"
      number: /[1-9][0-9]?/
      """

      grammar_run =
        Task.async(fn ->
          Scheduler.generate(server, "Say:", grammar: grammar, max_new_tokens: 24, seed: 2)
        end)

      for reply <- Task.await_many(json_runs, 120_000) do
        assert {:ok, result} = reply
        assert result.finish_reason in [:stop, :eos], inspect(result)
        assert_valid_json(result.text, @schema)
        assert result.stats.constraint_ms > 0
      end

      assert {:ok, %{text: code, finish_reason: reason}} = Task.await(regex_run, 120_000)
      assert reason in [:stop, :eos]
      assert code =~ ~r/\A#{@regex}\z/

      assert {:ok, %{text: said}} = Task.await(grammar_run, 120_000)
      assert said =~ ~r/\A(hello|bye) [1-9][0-9]?(,[1-9][0-9]?)*\z/
      assert %{running: 0, waiting: 0} = Scheduler.occupancy(server)
    end

    test "a free request beside constrained ones gives its solo tokens", ctx do
      server = ctx.server
      opts = [max_new_tokens: 24, ignore_eos: true]
      {:ok, solo} = Scheduler.generate(server, "The quick brown fox", opts)

      constrained =
        for _ <- 1..2 do
          Task.async(fn ->
            Scheduler.generate(server, @prompt, json_schema: @schema, max_new_tokens: 200)
          end)
        end

      {:ok, beside} = Scheduler.generate(server, "The quick brown fox", opts)
      assert beside.ids == solo.ids
      assert beside.stats.constraint_ms == 0

      for reply <- Task.await_many(constrained, 120_000) do
        assert {:ok, %{text: text}} = reply
        assert_valid_json(text, @schema)
      end
    end

    test "invalid constraints raise ArgumentError before anything is queued", ctx do
      server = ctx.server

      bad = [
        [json_schema: %{"type" => "strin"}],
        [json_schema: "{not json"],
        [json_schema: 12],
        [regex: "(ab"],
        [regex: 5],
        [grammar: "start: missing"],
        [json_schema: @schema, regex: "a"]
      ]

      for opts <- bad do
        assert_raise ArgumentError, fn -> Scheduler.submit(server, @prompt, opts) end
        assert_raise ArgumentError, fn -> Scheduler.generate(server, @prompt, opts) end
      end

      assert_raise ArgumentError, ~r/mutually exclusive/, fn ->
        Scheduler.submit(server, @prompt, json_schema: @schema, grammar: "start: \"a\"")
      end

      assert_raise ArgumentError, ~r/strin/, fn ->
        Scheduler.submit(server, @prompt, json_schema: %{"type" => "strin"})
      end

      refute_received {Scheduler, _, _}
      assert %{running: 0, waiting: 0} = Scheduler.occupancy(server)

      bare = start_supervised!({Scheduler, model: ctx.state}, id: :bare)

      assert_raise ArgumentError, ~r/needs a scheduler started with a :tokenizer/, fn ->
        Scheduler.submit(bare, [1, 2, 3], regex: "a")
      end

      assert %{running: 0, waiting: 0} = Scheduler.occupancy(bare)
    end
  end

  describe "run/4 and stream/5 with :scheduler" do
    test "options-level and per-input constraints equal the direct run", ctx do
      %{tokenizer: tok, state: state, server: server} = ctx

      inputs = [
        %{text: @prompt, json_schema: @schema},
        %{text: "A code:", regex: @regex},
        "The quick brown fox",
        %{text: "Say:", grammar: ~S(start: "yes" | "no")}
      ]

      opts = [max_new_tokens: 120]
      direct = TextGeneration.run(tok, state, inputs, opts)
      scheduled = TextGeneration.run(tok, state, inputs, opts ++ [scheduler: server])

      texts = fn outputs -> Enum.map(outputs, &hd(&1.results).text) end
      assert texts.(scheduled) == texts.(direct)
      [json, code, _free, yes_no] = texts.(scheduled)
      assert_valid_json(json, @schema)
      assert code =~ ~r/\A#{@regex}\z/
      assert yes_no in ["yes", "no"]

      [json_meta, _, free_meta, _] = Enum.map(scheduled, & &1.metadata)
      assert json_meta.constraint_ms > 0
      assert free_meta.constraint_ms == 0

      # The options' constraint applies to every input without its own.
      both =
        TextGeneration.run(
          tok,
          state,
          [@prompt, %{text: "A code:", regex: @regex}],
          opts ++ [scheduler: server, json_schema: @schema, sampler: :top_p_gpu, seed: 4]
        )

      [%{results: [%{text: json}]}, %{results: [%{text: code}]}] = both
      assert_valid_json(json, @schema)
      assert code =~ ~r/\A#{@regex}\z/
      assert %{running: 0, waiting: 0} = Scheduler.occupancy(server)
    end

    test "tool calls are parsed and a tool grammar forces valid ones", ctx do
      %{tokenizer: tok, state: state, server: server} = ctx

      tools = [
        %{
          "type" => "function",
          "function" => %{
            "name" => "get_weather",
            "parameters" => %{
              "type" => "object",
              "properties" => %{
                "city" => %{"type" => "string", "minLength" => 1, "maxLength" => 8}
              },
              "required" => ["city"],
              "additionalProperties" => false
            }
          }
        }
      ]

      messages = [%{role: "user", content: "The weather in Paris?"}]

      outputs =
        TextGeneration.run(tok, state, [%{messages: messages, seed: 1}, %{messages: messages}],
          scheduler: server,
          tools: tools,
          grammar: ToolCalls.grammar(tools, max_calls: 1),
          max_new_tokens: 150
        )

      assert length(outputs) == 2

      for output <- outputs do
        assert %{results: [%{tool_calls: calls, tool_call_errors: errors, text: text} = result]} =
                 output

        assert result.finish_reason in [:stop, :eos], text
        assert errors == [], text
        assert [%{name: "get_weather", arguments: args}] = calls, text
        assert valid?(args, hd(tools)["function"]["parameters"])
      end
    end

    test "streamed pieces are always a prefix of a valid output", ctx do
      %{tokenizer: tok, state: state} = ctx
      parent = self()

      # One decode step per call: text arrives a token or two at a time.
      server =
        start_supervised!(
          {Scheduler, model: state, tokenizer: tok, steps_per_call: 1, prefix_cache_bytes: 0},
          id: :one_step
        )

      result =
        TextGeneration.stream(tok, state, @prompt, &send(parent, {:piece, &1}),
          scheduler: server,
          json_schema: @schema,
          sampler: :top_p_gpu,
          seed: 9,
          max_new_tokens: 200
        )

      pieces = collect_pieces([])
      text = hd(result.results).text
      assert Enum.join(pieces) == text
      assert_valid_json(text, @schema)

      for prefix <- prefixes(pieces) do
        assert String.starts_with?(text, prefix)
        assert json_prefix?(prefix), "#{inspect(prefix)} cannot start valid JSON"
      end

      # Scheduler.stream/3: every prefix of the text matches the regex's
      # prefix language.
      chunks = server |> Scheduler.stream("A code:", regex: @regex, seed: 3) |> Enum.to_list()
      assert length(chunks) > 1
      texts = Enum.map(chunks, &elem(&1, 1))
      viable = ~r/\A([0-9]{0,2}|[0-9]{3}(-[a-z]{0,4})?)\z/

      for prefix <- prefixes(texts) do
        assert prefix =~ viable, inspect(prefix)
      end

      assert Enum.join(texts) =~ ~r/\A#{@regex}\z/
    end
  end

  defp collect_pieces(acc) do
    receive do
      {:piece, piece} -> collect_pieces([piece | acc])
    after
      0 -> Enum.reverse(acc)
    end
  end

  defp prefixes(pieces) do
    pieces
    |> Enum.scan(&(&2 <> &1))
    |> Enum.reject(&(&1 == ""))
  end

  # Whether `text` can start a JSON value: the decoder either takes it all
  # or fails within its last few bytes (an unfinished literal, number,
  # string or escape), never earlier.
  defp json_prefix?(text) do
    case Decoder.decode(text) do
      {:ok, _} ->
        true

      {:error, message} ->
        [at] = Regex.run(~r/at byte (\d+)$/, message, capture: :all_but_first)
        String.to_integer(at) >= byte_size(text) - 6
    end
  end
end
