defmodule EMLXAxon.StructuredOutputTest do
  use ExUnit.Case, async: true

  alias EMLXAxon.{TestFixtures, TestJSON, TextGeneration, Tokenizer, ToolCalls}
  alias EMLXAxon.Qwen3.Generate

  import EMLXAxon.TestSchema, only: [valid?: 2]

  @moduletag :fixtures

  doctest EMLXAxon.JSON.Decoder
  doctest EMLXAxon.ToolCalls

  @prompt "Answer in JSON:"

  setup_all do
    name = "qwen3-4bit-g64"
    %{tokenizer: TestFixtures.tokenizer(name), state: TestFixtures.model(name)}
  end

  defp decode(text) do
    {:ok, TestJSON.decode!(text)}
  rescue
    e -> {:error, e}
  end

  @schemas [
    %{
      "type" => "object",
      "properties" => %{
        "name" => %{"type" => "string", "maxLength" => 10},
        "age" => %{"type" => "integer", "minimum" => 18, "maximum" => 99},
        "home" => %{
          "type" => "object",
          "properties" => %{"city" => %{"type" => "string", "minLength" => 2, "maxLength" => 8}},
          "required" => ["city"],
          "additionalProperties" => false
        }
      },
      "required" => ["name", "home"],
      "additionalProperties" => false
    },
    %{
      "type" => "object",
      "properties" => %{
        "colors" => %{
          "type" => "array",
          "items" => %{"enum" => ["red", "green", "blue"]},
          "minItems" => 2,
          "maxItems" => 4
        },
        "mode" => %{"enum" => ["on", "off", 1]},
        "ratio" => %{"type" => "number", "minimum" => -50, "maximum" => 50},
        "flag" => %{"type" => "boolean"}
      },
      "required" => ["colors", "mode", "ratio", "flag"],
      "additionalProperties" => false
    },
    %{
      "type" => "array",
      "items" => %{"type" => "integer", "exclusiveMinimum" => -3, "exclusiveMaximum" => 40},
      "minItems" => 1,
      "maxItems" => 5
    }
  ]

  defp inputs(n, extra), do: for(i <- 1..n, do: Map.merge(%{text: @prompt, seed: i}, extra))

  describe "json_schema" do
    test "20 sampled outputs of each schema are JSON valid against it", ctx do
      for {schema, sampler} <- Enum.zip(@schemas, [:top_p_gpu, :top_p_cpu, :top_p_gpu]) do
        outputs =
          TextGeneration.run(ctx.tokenizer, ctx.state, inputs(20, %{}),
            json_schema: schema,
            sampler: sampler,
            top_p: 0.95,
            max_new_tokens: 200
          )

        for %{results: [%{text: text, finish_reason: reason}]} <- outputs do
          assert reason in [:stop, :eos], "#{inspect(reason)}: #{text}"
          assert {:ok, value} = decode(text), text
          assert valid?(value, schema), "#{text} breaks #{inspect(schema)}"
        end
      end
    end

    test "a schema may be JSON text, and Generate takes it too", ctx do
      schema =
        ~s({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})

      %{results: [%{text: text}]} =
        TextGeneration.run(ctx.tokenizer, ctx.state, @prompt, json_schema: schema)

      assert text in [~s({"ok": true}), ~s({"ok": false})]

      {:ok, ids} = Tokenizer.encode(ctx.tokenizer, @prompt)

      {:ok, %{text: text, finish_reason: :stop}} =
        Generate.generate(ctx.state, ids, tokenizer: ctx.tokenizer, regex: "(yes|no)!")

      assert text in ["yes!", "no!"]
    end

    test "streamed text is the output, piece by piece", ctx do
      schema = Enum.at(@schemas, 2)

      result =
        TextGeneration.stream(ctx.tokenizer, ctx.state, @prompt, &send(self(), {:piece, &1}),
          json_schema: schema,
          sampler: :top_p_cpu,
          seed: 3
        )

      pieces = collect_pieces([])
      assert [%{text: text}] = result.results
      assert IO.iodata_to_binary(pieces) == text
      assert {:ok, value} = decode(text)
      assert valid?(value, schema)
    end
  end

  defp collect_pieces(acc) do
    receive do
      {:piece, piece} -> collect_pieces([acc, piece])
    after
      0 -> acc
    end
  end

  describe "regex and grammar" do
    test "sampled outputs match", ctx do
      outputs =
        TextGeneration.run(
          ctx.tokenizer,
          ctx.state,
          inputs(20, %{regex: "[A-Z][a-z]{1,6} [0-9]{2}"}),
          sampler: :top_p_gpu
        )

      for %{results: [%{text: text}]} <- outputs do
        assert text =~ ~r/\A[A-Z][a-z]{1,6} [0-9]{2}\z/, text
      end

      grammar = """
      start: "sum(" num ("+" num)* ")"
      num: /[0-9]/
      """

      outputs =
        TextGeneration.run(ctx.tokenizer, ctx.state, inputs(20, %{grammar: grammar}),
          sampler: :top_p_cpu,
          max_new_tokens: 30
        )

      for %{results: [%{text: text, finish_reason: reason}]} <- outputs do
        # An unbounded sum may run to the token budget, but stays in the grammar.
        pattern =
          if reason == :length,
            do: ~r/\Asum\([0-9](\+[0-9])*\+?\z/,
            else: ~r/\Asum\([0-9](\+[0-9])*\)\z/

        assert text =~ pattern, "#{inspect(reason)}: #{text}"
      end
    end

    test "constrained and free inputs share a batch; free rows are unchanged", ctx do
      schema = Enum.at(@schemas, 1)
      free = [%{text: "Hello there", seed: 1}, %{text: @prompt, seed: 2}]

      constrained = [
        %{text: @prompt, seed: 3, json_schema: schema},
        %{text: "Hi", seed: 4, regex: "ab+c"}
      ]

      opts = [sampler: :top_p_gpu, max_new_tokens: 80]

      [a, c1, b, c2] =
        TextGeneration.run(
          ctx.tokenizer,
          ctx.state,
          [hd(free), hd(constrained), List.last(free), List.last(constrained)],
          opts
        )

      [a0, b0] = TextGeneration.run(ctx.tokenizer, ctx.state, free, opts)
      assert hd(a.results).token_ids == hd(a0.results).token_ids
      assert hd(b.results).token_ids == hd(b0.results).token_ids

      assert {:ok, value} = decode(hd(c1.results).text), hd(c1.results).text
      assert valid?(value, schema)
      assert hd(c2.results).text =~ ~r/\Aab+c\z/
    end
  end

  describe "errors" do
    test "bad constraints are ArgumentErrors before generation", ctx do
      run = fn opts -> TextGeneration.run(ctx.tokenizer, ctx.state, @prompt, opts) end

      assert_raise ArgumentError, ~r/mutually exclusive/, fn ->
        run.(json_schema: %{"type" => "string"}, regex: "a")
      end

      assert_raise ArgumentError, ~r/:regex .* to be a string/, fn -> run.(regex: 5) end
      assert_raise ArgumentError, ~r/not valid JSON/, fn -> run.(json_schema: "{oops") end
      assert_raise ArgumentError, ~r/invalid regex/, fn -> run.(regex: "(a") end

      assert_raise ArgumentError, ~r/invalid grammar/, fn ->
        run.(grammar: "start: nothing_here")
      end

      assert_raise ArgumentError, ~r/dependentSchemas/, fn ->
        run.(json_schema: %{"type" => "object", "dependentSchemas" => %{"a" => %{}}})
      end

      assert_raise ArgumentError, ~r/mutually exclusive/, fn ->
        TextGeneration.run(ctx.tokenizer, ctx.state, %{
          text: "x",
          regex: "a",
          grammar: "start: \"a\""
        })
      end

      {:ok, ids} = Tokenizer.encode(ctx.tokenizer, @prompt)

      assert_raise ArgumentError, ~r/needs the :tokenizer/, fn ->
        Generate.generate(ctx.state, ids, regex: "a")
      end
    end
  end

  describe "tool calls" do
    test "rendering equals transformers' apply_chat_template with tools", ctx do
      cases =
        Code.eval_file(Path.join(TestFixtures.fixtures_dir(), "tool_renders.exs")) |> elem(0)

      assert length(cases) >= 3

      for %{"messages" => messages, "tools" => tools, "text" => text} = c <- cases do
        opts =
          [add_generation_prompt: c["add_generation_prompt"], tools: tools] ++
            if Map.has_key?(c, "enable_thinking"),
              do: [enable_thinking: c["enable_thinking"]],
              else: []

        assert Tokenizer.apply_chat_template(ctx.tokenizer, messages, opts) == {:ok, text}
      end
    end

    test "parses well-formed and malformed blocks" do
      text = """
      Let me check.
      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}
      </tool_call>
      <tool_call>
      {"name": "add", "arguments": "{\\"a\\": 2.5, \\"b\\": -1e2}"}
      </tool_call>
      <tool_call>{"name": "broken", "arguments": {"x": }</tool_call>
      <tool_call>{"arguments": {}}</tool_call>
      <tool_call>{"name": "f", "arguments": [1]}</tool_call>
      <tool_call>{"name": "never closed"
      """

      assert {:ok, calls, errors} = ToolCalls.parse(text)

      assert calls == [
               %{name: "get_weather", arguments: %{"city" => "Paris", "days" => [1, 2]}},
               %{name: "add", arguments: %{"a" => 2.5, "b" => -100.0}}
             ]

      assert [not_json, no_name, not_object, unclosed] = errors
      assert not_json =~ "not valid JSON"
      assert no_name =~ "no \"name\""
      assert not_object =~ "not a JSON object"
      assert unclosed =~ "never closed"
      assert ToolCalls.parse("no calls here") == {:ok, [], []}
    end

    test "a tool grammar makes the model call the tools with valid arguments", ctx do
      tools = [
        %{
          "type" => "function",
          "function" => %{
            "name" => "get_weather",
            "parameters" => %{
              "type" => "object",
              "properties" => %{
                "city" => %{"type" => "string", "minLength" => 1, "maxLength" => 8},
                "unit" => %{"enum" => ["celsius", "fahrenheit"]}
              },
              "required" => ["city"],
              "additionalProperties" => false
            }
          }
        },
        %{
          "type" => "function",
          "function" => %{
            "name" => "add",
            "parameters" => %{
              "type" => "object",
              "properties" => %{
                "a" => %{"type" => "integer", "minimum" => -9, "maximum" => 99},
                "b" => %{"type" => "integer", "minimum" => 0, "maximum" => 9}
              },
              "required" => ["a", "b"],
              "additionalProperties" => false
            }
          }
        }
      ]

      messages = [%{role: "user", content: "What is 2+3, and the weather in Paris?"}]
      inputs = for seed <- 1..10, do: %{messages: messages, seed: seed}

      outputs =
        TextGeneration.run(ctx.tokenizer, ctx.state, inputs,
          tools: tools,
          grammar: ToolCalls.grammar(tools, max_calls: 2),
          sampler: :top_p_gpu,
          max_new_tokens: 150
        )

      complete =
        for %{results: [%{text: text, tool_calls: calls, tool_call_errors: errors} = result]} <-
              outputs do
          # A row out of tokens may end inside a call; every other call is whole.
          errors =
            if result.finish_reason == :length,
              do: Enum.reject(errors, &(&1 =~ "never closed")),
              else: errors

          assert errors == [], text
          assert [_ | _] = calls, text

          for %{name: name, arguments: args} <- calls do
            tool = Enum.find(tools, &(&1["function"]["name"] == name))
            assert tool, "unknown tool #{name}"
            assert valid?(args, tool["function"]["parameters"]), "#{inspect(args)} for #{name}"
          end

          result.finish_reason != :length
        end

      assert Enum.any?(complete)
    end
  end

  describe "JSON decoder" do
    test "decodes and refuses" do
      alias EMLXAxon.JSON.Decoder

      assert Decoder.decode(
               ~s( {"a": [true, false, null, -0.5e1, 12], "\\u00e9\\ud83d\\ude00": "\\n\\t"} )
             ) ==
               {:ok, %{"a" => [true, false, nil, -5.0, 12], "é😀" => "\n\t"}}

      for bad <- [
            "",
            "[1,]",
            "{\"a\" 1}",
            "01",
            "\"\\x\"",
            "[1] 2",
            "{\"a\":}",
            "\"\\ud800\"",
            "nul"
          ] do
        assert {:error, message} = Decoder.decode(bad), inspect(bad)
        assert message =~ "expected"
      end

      assert Decoder.decode(EMLXAxon.JSON.encode!(%{"k" => ["x\"y", 1.5, %{}]})) ==
               {:ok, %{"k" => ["x\"y", 1.5, %{}]}}
    end
  end
end
