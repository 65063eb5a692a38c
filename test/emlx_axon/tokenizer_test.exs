defmodule EMLXAxon.TokenizerTest do
  use ExUnit.Case, async: true

  alias EMLXAxon.{Error, TestFixtures, Tokenizer}

  @moduletag :fixtures

  setup_all do
    %{tokenizer: TestFixtures.tokenizer()}
  end

  describe "load/1" do
    test "loads from a checkpoint directory, {:local, dir} and a tokenizer.json path" do
      dir = TestFixtures.path("qwen3-4bit-g64")

      assert {:ok, %Tokenizer{path: ^dir}} = Tokenizer.load(dir)
      assert {:ok, %Tokenizer{path: ^dir}} = Tokenizer.load({:local, dir})

      json = Path.join(TestFixtures.tokenizer_dir(), "tokenizer.json")
      assert {:ok, %Tokenizer{path: ^json} = tokenizer} = Tokenizer.load(json)
      assert {:ok, [9707, 11, 1879, 0]} = Tokenizer.encode(tokenizer, "Hello, world!")
    end

    test "expands ~ and relative paths" do
      relative = Path.relative_to_cwd(TestFixtures.path("qwen3-4bit-g64"))
      assert {:ok, %Tokenizer{path: path}} = Tokenizer.load(relative)
      assert path == TestFixtures.path("qwen3-4bit-g64")
    end

    test "returns an :io error for a missing path" do
      assert {:error, %Error{kind: :io, message: message}} = Tokenizer.load("/no/such/tokenizer")
      assert message =~ "/no/such/tokenizer"
    end

    test "returns an error for a directory without tokenizer.json" do
      dir = Path.join(System.tmp_dir!(), "emlx_axon_empty_#{System.unique_integer([:positive])}")
      File.mkdir_p!(dir)
      on_exit(fn -> File.rm_rf!(dir) end)

      assert {:error, %Error{kind: kind}} = Tokenizer.load(dir)
      assert kind in [:io, :tokenizer]
    end

    test "returns an error for a malformed tokenizer.json" do
      dir = Path.join(System.tmp_dir!(), "emlx_axon_bad_#{System.unique_integer([:positive])}")
      File.mkdir_p!(dir)
      File.write!(Path.join(dir, "tokenizer.json"), "{ not json")
      on_exit(fn -> File.rm_rf!(dir) end)

      assert {:error, %Error{kind: kind}} = Tokenizer.load(dir)
      assert kind in [:json, :tokenizer]
    end

    test "raises ArgumentError for a non-path" do
      assert_raise ArgumentError, ~r/expected a path/, fn -> Tokenizer.load(:nope) end
    end

    test "load!/1 raises EMLXAxon.Error" do
      assert_raise Error, ~r/\(io\)/, fn -> Tokenizer.load!("/no/such/tokenizer") end
    end
  end

  describe "encode/3 and decode/3" do
    test "encodings match the reference tokenizer", %{tokenizer: tokenizer} do
      for %{"text" => text, "ids" => ids} <- TestFixtures.encodings() do
        assert Tokenizer.encode(tokenizer, text) == {:ok, ids}, "encoding #{inspect(text)}"
        assert Tokenizer.decode(tokenizer, ids) == {:ok, text}, "decoding #{inspect(ids)}"
      end
    end

    test "add_special_tokens adds nothing for Qwen", %{tokenizer: tokenizer} do
      assert Tokenizer.encode(tokenizer, "Hello, world!", add_special_tokens: true) ==
               Tokenizer.encode(tokenizer, "Hello, world!", add_special_tokens: false)
    end

    test "special tokens are encoded as such", %{tokenizer: tokenizer} do
      assert {:ok, [151_644]} = Tokenizer.encode(tokenizer, "<|im_start|>")
    end

    test "skip_special_tokens", %{tokenizer: tokenizer} do
      {:ok, ids} = Tokenizer.encode(tokenizer, "<|im_start|>user\nHi<|im_end|>")
      assert {:ok, "user\nHi"} = Tokenizer.decode(tokenizer, ids)
      assert {:ok, "user\nHi"} = Tokenizer.decode(tokenizer, ids, skip_special_tokens: true)

      assert {:ok, "<|im_start|>user\nHi<|im_end|>"} =
               Tokenizer.decode(tokenizer, ids, skip_special_tokens: false)
    end

    test "decode of an empty list is empty", %{tokenizer: tokenizer} do
      assert {:ok, ""} = Tokenizer.decode(tokenizer, [])
    end

    test "bad arguments raise ArgumentError", %{tokenizer: tokenizer} do
      assert_raise ArgumentError, ~r/string/, fn -> Tokenizer.encode(tokenizer, 123) end

      assert_raise ArgumentError, ~r/unknown option :bad/, fn ->
        Tokenizer.encode(tokenizer, "a", bad: 1)
      end

      assert_raise ArgumentError, ~r/:add_special_tokens to be a boolean/, fn ->
        Tokenizer.encode(tokenizer, "a", add_special_tokens: :yes)
      end

      assert_raise ArgumentError, ~r/non-negative token ids/, fn ->
        Tokenizer.decode(tokenizer, [1, -2])
      end

      assert_raise ArgumentError, ~r/non-negative token ids/, fn ->
        Tokenizer.decode(tokenizer, "abc")
      end
    end
  end

  describe "apply_chat_template/3" do
    test "renders exactly as transformers does", %{tokenizer: tokenizer} do
      for %{"messages" => messages, "text" => text} = case <- TestFixtures.chat_renders() do
        opts =
          [add_generation_prompt: Map.fetch!(case, "add_generation_prompt")] ++
            case Map.fetch(case, "enable_thinking") do
              {:ok, thinking} -> [enable_thinking: thinking]
              :error -> []
            end

        assert Tokenizer.apply_chat_template(tokenizer, messages, opts) == {:ok, text},
               "rendering #{inspect(case)}"
      end
    end

    test "accepts atom keys, string keys, tuples and atom roles", %{tokenizer: tokenizer} do
      [%{"messages" => [system, user]} = case | _] = TestFixtures.chat_renders()
      expected = {:ok, case["text"]}

      atom_keys = [
        %{role: system["role"], content: system["content"]},
        %{role: user["role"], content: user["content"]}
      ]

      tuples = [{:system, system["content"]}, {"user", user["content"]}]

      assert Tokenizer.apply_chat_template(tokenizer, [system, user]) == expected
      assert Tokenizer.apply_chat_template(tokenizer, atom_keys) == expected
      assert Tokenizer.apply_chat_template(tokenizer, tuples) == expected
    end

    test "enable_thinking: false adds an empty think block", %{tokenizer: tokenizer} do
      messages = [%{role: "user", content: "Hi"}]
      {:ok, default} = Tokenizer.apply_chat_template(tokenizer, messages)
      {:ok, no_think} = Tokenizer.apply_chat_template(tokenizer, messages, enable_thinking: false)
      assert no_think == default <> "<think>\n\n</think>\n\n"
    end

    test "bad messages raise ArgumentError", %{tokenizer: tokenizer} do
      assert_raise ArgumentError, ~r/non-empty list of chat messages/, fn ->
        Tokenizer.apply_chat_template(tokenizer, [])
      end

      assert_raise ArgumentError, ~r/chat message/, fn ->
        Tokenizer.apply_chat_template(tokenizer, [%{role: "user"}])
      end

      assert_raise ArgumentError, ~r/role to be a string or atom/, fn ->
        Tokenizer.apply_chat_template(tokenizer, [%{role: 1, content: "x"}])
      end

      assert_raise ArgumentError, ~r/unknown option :thinking/, fn ->
        Tokenizer.apply_chat_template(tokenizer, [{"user", "x"}], thinking: true)
      end

      assert_raise ArgumentError, ~r/:enable_thinking to be a boolean or nil/, fn ->
        Tokenizer.apply_chat_template(tokenizer, [{"user", "x"}], enable_thinking: "no")
      end
    end
  end

  test "info/1", %{tokenizer: tokenizer} do
    assert {:ok, %{vocab_size: vocab, eos_token_ids: eos, has_chat_template: true}} =
             Tokenizer.info(tokenizer)

    assert vocab > 150_000
    assert 151_645 in eos
  end

  test "a tokenizer without a chat template reports so" do
    json = Path.join(TestFixtures.tokenizer_dir(), "tokenizer.json")

    dir =
      Path.join(System.tmp_dir!(), "emlx_axon_notemplate_#{System.unique_integer([:positive])}")

    File.mkdir_p!(dir)
    File.cp!(json, Path.join(dir, "tokenizer.json"))
    on_exit(fn -> File.rm_rf!(dir) end)

    {:ok, tokenizer} = Tokenizer.load(dir)
    assert {:ok, %{has_chat_template: false}} = Tokenizer.info(tokenizer)

    assert {:error, %Error{kind: :template}} =
             Tokenizer.apply_chat_template(tokenizer, [{"user", "Hi"}])
  end
end
