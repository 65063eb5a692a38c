defmodule EMLXAxon.OptionsTest do
  # Every entry point checks its options with one schema, which also holds
  # their defaults and writes their documentation.
  use ExUnit.Case, async: false

  alias EMLXAxon.{Options, Scheduler, TestFixtures, TextGeneration, Tokenizer}
  alias EMLXAxon.Qwen3.{Generate, Loader}
  alias EMLXAxon.TextGeneration.Config

  @schema [
    count: [type: :pos_integer, default: 3, doc: "how many"],
    name: [type: {:or, [nil, :string]}, doc: "a name"],
    mode: [type: {:in, [:a, :b]}, default: :a, doc: "the mode"],
    stop: [type: {:custom, {Options, :stop}, "strings"}, default: [], doc: "stops"],
    must: [type: :boolean, required: true, doc: "a must"]
  ]

  describe "the schema facility" do
    test "fills defaults, keeps given values and normalizes them" do
      assert Options.validate!([must: true, stop: "x"], @schema, "f/1") ==
               %{count: 3, name: nil, mode: :a, stop: ["x"], must: true}

      assert %{count: 7, mode: :b} =
               Options.validate!([must: false, count: 7, mode: :b], @schema, "f/1")
    end

    test "names the option and what it accepts" do
      assert_raise ArgumentError, "expected :count to be a positive integer, got: 0 in f/1", fn ->
        Options.validate!([must: true, count: 0], @schema, "f/1")
      end

      assert_raise ArgumentError, ~r/expected :mode to be one of :a, :b, got: :c/, fn ->
        Options.validate!([must: true, mode: :c], @schema, "f/1")
      end

      assert_raise ArgumentError, ~r/expected :name to be nil or a string, got: 1/, fn ->
        Options.validate!([must: true, name: 1], @schema, "f/1")
      end

      assert_raise ArgumentError,
                   ~r/unknown option :other for f\/1, valid options are: :count, :name/,
                   fn ->
                     Options.validate!([must: true, other: 1], @schema, "f/1")
                   end

      assert_raise ArgumentError,
                   ~r/missing the required option :must \(a boolean\) for f\/1/,
                   fn ->
                     Options.validate!([], @schema, "f/1")
                   end

      assert_raise ArgumentError, ~r/f\/1 options to be a keyword list/, fn ->
        Options.validate!(:nope, @schema, "f/1")
      end
    end

    test "documents each option with what it accepts and its default" do
      docs = Options.docs(@schema)
      assert docs =~ "* `:count` - how many (a positive integer; default: `3`)"
      assert docs =~ "* `:mode` - the mode (one of :a, :b; default: `:a`)"
      assert docs =~ "* `:must` - a must (a boolean; required)"
      assert length(String.split(docs, "\n  * ")) == length(@schema)
    end
  end

  describe "the functions' documentation is their schema's" do
    # Every option of the schema, with what it accepts, is in the @doc.
    defp assert_documented(module, fun, arity, schema) do
      {:docs_v1, _, _, _, _, _, docs} = Code.fetch_docs(module)

      [doc] = for {{:function, ^fun, ^arity}, _, _, %{"en" => doc}, _} <- docs, do: doc

      # Compare without line breaks: the generated list is wrapped.
      flat = String.replace(doc, ~r/\s+/, " ")

      for {key, spec} <- schema do
        assert flat =~ "* `#{inspect(key)}` - ", "#{inspect(key)} is not documented in #{fun}"
        assert flat =~ Options.describe(spec[:type]), "#{inspect(key)}'s type is not documented"
      end
    end

    test "EMLXAxon.TextGeneration" do
      assert_documented(TextGeneration, :serving, 3, Config.serving_schema())
      assert_documented(TextGeneration, :run, 4, Config.run_schema())
      assert_documented(TextGeneration, :stream, 5, Config.run_schema())

      loader = Keyword.take(Config.from_mlx4bit_schema(), [:dtype, :quantize])
      assert_documented(TextGeneration, :from_mlx4bit, 3, loader)
    end

    test "the loader, the scheduler and the token-level generation" do
      assert_documented(Loader, :load, 2, Loader.schema())
      assert_documented(Scheduler, :start_link, 1, Scheduler.__schema__(:start_link))
      assert_documented(Scheduler, :submit, 3, Scheduler.__schema__(:submit))
      assert_documented(Generate, :generate, 3, Generate.__schema__(:generate))
    end
  end

  describe "tools" do
    test "a tool is a function definition with a name" do
      assert {:ok, nil} = Options.tools(nil)
      assert {:ok, []} = Options.tools([])

      for tool <- [
            %{type: "function", function: %{name: "f", parameters: %{type: "object"}}},
            %{"type" => "function", "function" => %{"name" => "f", "description" => "d"}},
            %{name: "f"}
          ] do
        assert {:ok, [^tool]} = Options.tools([tool])
      end

      for bad <- [
            %{"bad" => 1},
            %{type: "function", function: %{name: ""}},
            %{type: "retrieval", function: %{name: "f"}},
            %{function: "f"},
            %{name: "f", parameters: "object"},
            %{name: "f", description: 3},
            :f
          ] do
        assert {:error, reason} = Options.tools([%{name: "ok"}, bad])
        assert reason =~ "tool 1: "
      end

      assert :error = Options.tools(:nope)
    end
  end

  describe "entry points" do
    @describetag :fixtures

    setup do
      %{state: TestFixtures.model("qwen3-4bit-g64"), tokenizer: TestFixtures.tokenizer()}
    end

    test "serving/3 refuses bad tools when it is built, naming :tools", ctx do
      %{tokenizer: tokenizer, state: state} = ctx

      for bad <- [:nope, %{name: "f"}, [%{"bad" => 1}], [%{name: "f"}, "g"]] do
        assert_raise ArgumentError, ~r/expected :tools to be nil or a list of tools/, fn ->
          TextGeneration.serving(tokenizer, state, tools: bad)
        end
      end

      assert_raise ArgumentError, ~r/:tools .*tool 0: a tool needs a non-empty string name/, fn ->
        TextGeneration.serving(tokenizer, state, tools: [%{"bad" => 1}])
      end
    end

    test "run/4, stream/5 and from_mlx4bit/3 refuse bad tools too", ctx do
      %{tokenizer: tokenizer, state: state} = ctx

      assert_raise ArgumentError, ~r/expected :tools/, fn ->
        TextGeneration.run(tokenizer, state, "Hi", tools: [%{"bad" => 1}])
      end

      assert_raise ArgumentError, ~r/expected :tools/, fn ->
        TextGeneration.stream(tokenizer, state, "Hi", fn _ -> :ok end, tools: :nope)
      end

      # Before anything is loaded.
      assert_raise ArgumentError, ~r/expected :tools.*from_mlx4bit\/3/, fn ->
        TextGeneration.from_mlx4bit("/no/such/model", nil, tools: [%{"bad" => 1}])
      end

      assert_raise ArgumentError, ~r/expected :dtype to be one of/, fn ->
        TextGeneration.from_mlx4bit("/no/such/model", nil, dtype: :int8)
      end

      assert_raise ArgumentError, ~r/expected :tools/, fn ->
        Tokenizer.apply_chat_template(tokenizer, [%{role: "user", content: "Hi"}],
          tools: [%{"bad" => 1}]
        )
      end
    end

    test "valid tools reach the chat template and the results", ctx do
      %{tokenizer: tokenizer, state: state} = ctx

      tools = [
        %{type: "function", function: %{name: "get_weather", parameters: %{type: "object"}}}
      ]

      %{results: [result]} =
        TextGeneration.run(tokenizer, state, [%{role: "user", content: "Hi"}],
          tools: tools,
          max_new_tokens: 4
        )

      assert %{tool_calls: calls, tool_call_errors: errors} = result
      assert is_list(calls) and is_list(errors)
    end

    test "each entry point names its options in its errors", ctx do
      %{tokenizer: tokenizer, state: state} = ctx

      assert_raise ArgumentError,
                   ~r/unknown option :bogus for EMLXAxon.TextGeneration.serving\/3/,
                   fn ->
                     TextGeneration.serving(tokenizer, state, bogus: 1)
                   end

      assert_raise ArgumentError,
                   ~r/expected :chunk_size to be nil or a positive integer, got: 0 in EMLXAxon.TextGeneration.run\/4/,
                   fn ->
                     TextGeneration.run(tokenizer, state, "Hi", chunk_size: 0)
                   end

      assert_raise ArgumentError,
                   ~r/expected :on_chunk to be a function of one argument or nil/,
                   fn ->
                     Generate.generate(state, [1, 2], on_chunk: fn -> :ok end)
                   end

      assert_raise ArgumentError,
                   ~r/expected :slots to be a positive integer, got: 0 in EMLXAxon.Scheduler.start_link\/1/,
                   fn ->
                     Scheduler.start_link(model: state, slots: 0)
                   end

      assert_raise ArgumentError, ~r/missing the required option :model/, fn ->
        Scheduler.start_link(slots: 2)
      end

      assert_raise ArgumentError, ~r/expected :name to be nil or a GenServer name/, fn ->
        Scheduler.start_link(model: state, name: "scheduler")
      end

      assert_raise ArgumentError, ~r/expected :strict to be a boolean/, fn ->
        Loader.load(TestFixtures.path("qwen3-4bit-g64"), strict: :yes)
      end
    end

    test "the scheduler's requests are checked before they are queued", ctx do
      server = start_supervised!({Scheduler, model: ctx.state, slots: 1})

      assert_raise ArgumentError,
                   ~r/expected :timeout to be a non-negative integer \(milliseconds\) or :infinity/,
                   fn ->
                     Scheduler.submit(server, [1, 2], timeout: -1)
                   end

      assert_raise ArgumentError,
                   ~r/unknown option :chunk_size for EMLXAxon.Scheduler.submit\/3/,
                   fn ->
                     Scheduler.submit(server, [1, 2], chunk_size: 4)
                   end

      assert Scheduler.occupancy(server).waiting == 0
    end
  end
end
