defmodule EMLXAxon.TextGenerationTest do
  use ExUnit.Case, async: true

  alias EMLXAxon.{Error, TestFixtures, TextGeneration, Tokenizer}
  alias EMLXAxon.TestForeignTokenizers, as: ForeignTokenizers

  @moduletag :fixtures

  @plain_text "The quick brown fox jumps over the lazy dog."
  @chat [%{role: "user", content: "Give me a short introduction to large language models."}]
  @opts [max_new_tokens: 16]

  setup_all do
    name = "qwen3-4bit-g64"

    %{
      tokenizer: TestFixtures.tokenizer(name),
      state: TestFixtures.model(name),
      reference: TestFixtures.reference(name)["prompts"]
    }
  end

  describe "run/4" do
    test "greedy output equals the reference for every fixture" do
      for name <- TestFixtures.models() do
        tokenizer = TestFixtures.tokenizer(name)
        state = TestFixtures.model(name)
        reference = TestFixtures.reference(name)["prompts"]

        for {prompt, input} <- [{"plain", @plain_text}, {"chat", @chat}] do
          assert {:ok, %{results: [%{token_ids: ids}]}} =
                   run_result(tokenizer, state, input, @opts)

          assert ids == reference[prompt]["greedy_ids"], "#{name} #{prompt}"
        end
      end
    end

    test "output shape", %{tokenizer: tokenizer, state: state, reference: reference} do
      greedy = reference["plain"]["greedy_ids"]

      assert %{
               results: [
                 %{
                   generated_text: text,
                   text: text,
                   num_tokens: 16,
                   token_ids: ^greedy,
                   finish_reason: :length,
                   token_summary: %{input: 10, output: 16, padding: 0}
                 }
               ],
               metadata: metadata
             } = TextGeneration.run(tokenizer, state, @plain_text, @opts)

      assert {:ok, ^text} = Tokenizer.decode(tokenizer, greedy)

      assert %{
               prompt_tokens: 10,
               generated_tokens: 16,
               batch_size: 1,
               prefill_ms: prefill,
               decode_ms: decode,
               decode_tokens_per_s: tps,
               time_to_first_token_ms: ttft,
               total_ms: total
             } = metadata

      # profile_timing defaults to true here
      assert Enum.all?([prefill, decode, tps, ttft, total], &(is_float(&1) and &1 > 0))
    end

    test "all input forms", %{tokenizer: tokenizer, state: state, reference: reference} do
      plain = reference["plain"]["greedy_ids"]
      chat = reference["chat"]["greedy_ids"]
      [%{content: content}] = @chat

      for {input, opts, expected} <- [
            {@plain_text, [], plain},
            {%{text: @plain_text}, [], plain},
            {%{input_ids: reference["plain"]["prompt_ids"]}, [], plain},
            {@chat, [], chat},
            {%{messages: @chat}, [], chat},
            {[{"user", content}], [], chat},
            {[%{"role" => "user", "content" => content}], [], chat},
            {content, [chat: true], chat},
            {%{text: content}, [chat: true], chat}
          ] do
        assert %{results: [%{token_ids: ^expected}]} =
                 TextGeneration.run(tokenizer, state, input, @opts ++ opts),
               "input #{inspect(input)} with #{inspect(opts)}"
      end
    end

    test "a list is a batch; each row equals its single run", %{
      tokenizer: tokenizer,
      state: state
    } do
      inputs = [@plain_text, @chat, "Hello", %{messages: [%{role: "user", content: "Hi!"}]}]
      singles = Enum.map(inputs, &TextGeneration.run(tokenizer, state, &1, @opts))
      batch = TextGeneration.run(tokenizer, state, inputs, @opts)

      assert length(batch) == 4

      longest = singles |> Enum.map(& &1.metadata.prompt_tokens) |> Enum.max()

      for {single, batched} <- Enum.zip(singles, batch) do
        [single_result] = single.results
        [batched_result] = batched.results
        # The same result, but for the left padding the batch gave the row.
        assert %{batched_result | token_summary: single_result.token_summary} == single_result
        assert batched_result.token_summary.padding == longest - single.metadata.prompt_tokens
        assert batched_result.token_summary.input == single.metadata.prompt_tokens
        assert batched.metadata.batch_size == 4
        assert batched.metadata.prompt_tokens == single.metadata.prompt_tokens
      end

      assert [%{results: [_]}] = TextGeneration.run(tokenizer, state, [@plain_text], @opts)
      assert [_, _] = TextGeneration.run(tokenizer, state, [@chat, @chat], @opts)
    end

    test "temperature 0 decodes greedily", %{
      tokenizer: tokenizer,
      state: state,
      reference: reference
    } do
      greedy = reference["plain"]["greedy_ids"]

      for sampler <- [:top_p_cpu, :top_p_gpu] do
        assert %{results: [%{token_ids: ^greedy}]} =
                 TextGeneration.run(
                   tokenizer,
                   state,
                   @plain_text,
                   @opts ++ [sampler: sampler, temperature: 0]
                 )
      end
    end

    test "an input's own :seed", %{tokenizer: tokenizer, state: state} do
      sample = @opts ++ [sampler: :top_p_cpu, temperature: 1.5, top_p: 1.0]
      seeded = fn seed -> %{text: @plain_text, seed: seed} end
      ids = fn output -> hd(output.results).token_ids end

      alone = ids.(TextGeneration.run(tokenizer, state, seeded.(7), sample))
      assert ids.(TextGeneration.run(tokenizer, state, seeded.(7), sample)) == alone
      refute ids.(TextGeneration.run(tokenizer, state, seeded.(8), sample)) == alone

      # The seed belongs to the input: batch-mates, their seeds and their
      # place in the batch do not change it.
      for batch <- [
            [seeded.(7), seeded.(8)],
            [%{text: "Hello", seed: 3}, seeded.(7), @chat],
            [seeded.(8), %{messages: @chat, seed: 1}, seeded.(7)]
          ] do
        outputs = TextGeneration.run(tokenizer, state, batch, sample)
        index = Enum.find_index(batch, &(&1 == seeded.(7)))
        assert ids.(Enum.at(outputs, index)) == alone, inspect(batch)
      end

      # Equal to the :seed option given for the call.
      assert ids.(TextGeneration.run(tokenizer, state, @plain_text, sample ++ [seed: 7])) ==
               alone

      for bad <- [-1, 1.5, "7"] do
        assert_raise ArgumentError, ~r/:seed to be nil or a non-negative integer/, fn ->
          TextGeneration.run(tokenizer, state, seeded.(bad), sample)
        end
      end

      assert_raise ArgumentError, ~r/unknown key\(s\) :temperature/, fn ->
        TextGeneration.run(tokenizer, state, %{text: "x", temperature: 2}, sample)
      end
    end

    test "enable_thinking", %{tokenizer: tokenizer, state: state} do
      {:ok, prompt} = Tokenizer.apply_chat_template(tokenizer, @chat, enable_thinking: false)
      {:ok, ids} = Tokenizer.encode(tokenizer, prompt)

      assert TextGeneration.run(tokenizer, state, @chat, @opts ++ [enable_thinking: false]).results ==
               TextGeneration.run(tokenizer, state, %{input_ids: ids}, @opts).results
    end

    test "sampling options", %{tokenizer: tokenizer, state: state, reference: reference} do
      greedy = reference["plain"]["greedy_ids"]
      sample = @opts ++ [sampler: :top_p_cpu, temperature: 1.3, top_p: 0.95, seed: 7]

      first = TextGeneration.run(tokenizer, state, @plain_text, sample)
      assert TextGeneration.run(tokenizer, state, @plain_text, sample).results == first.results
      assert hd(first.results).num_tokens == 16

      assert %{results: [%{token_ids: ^greedy}]} =
               TextGeneration.run(
                 tokenizer,
                 state,
                 @plain_text,
                 @opts ++ [sampler: :top_p_gpu, top_k: 1, seed: 1]
               )

      assert %{results: [%{token_ids: ^greedy}]} =
               TextGeneration.run(
                 tokenizer,
                 state,
                 @plain_text,
                 @opts ++ [sampler: :top_p_cpu, min_p: 0.999]
               )
    end

    test "stop strings", %{tokenizer: tokenizer, state: state, reference: reference} do
      greedy = reference["plain"]["greedy_ids"]
      {k, prefix, stop} = TestFixtures.stop_string(tokenizer, greedy)

      assert %{
               results: [
                 %{finish_reason: :stop, generated_text: ^prefix, token_ids: ids, num_tokens: n}
               ]
             } = TextGeneration.run(tokenizer, state, @plain_text, @opts ++ [stop: stop])

      assert ids == Enum.take(greedy, k + 1)
      assert n == k + 1
    end

    test "eos", %{tokenizer: tokenizer, state: state, reference: reference} do
      greedy = reference["plain"]["greedy_ids"]
      eos = Enum.at(greedy, 5)
      at = Enum.find_index(greedy, &(&1 == eos))
      {:ok, text} = Tokenizer.decode(tokenizer, Enum.take(greedy, at))

      assert %{results: [%{finish_reason: :eos, token_ids: ids, generated_text: ^text}]} =
               TextGeneration.run(tokenizer, state, @plain_text, @opts ++ [eos_token_ids: [eos]])

      assert ids == Enum.take(greedy, at + 1)

      assert %{results: [%{finish_reason: :length, num_tokens: 16}]} =
               TextGeneration.run(
                 tokenizer,
                 state,
                 @plain_text,
                 @opts ++ [eos_token_ids: [eos], ignore_eos: true]
               )
    end

    test "generated ids outside the tokenizer's vocabulary do not fail generation",
         %{tokenizer: tokenizer, state: state} do
      # The model's vocabulary (151936) is padded past the tokenizer's (151669);
      # this random model's greedy output for "Elixir" contains padding ids.
      {:ok, %{vocab_size: vocab}} = Tokenizer.info(tokenizer)

      assert %{results: [%{token_ids: ids, generated_text: text} = result]} =
               TextGeneration.run(tokenizer, state, "Elixir", @opts)

      assert Enum.any?(ids, &(&1 >= vocab))
      {:ok, expected} = Tokenizer.decode(tokenizer, Enum.filter(ids, &(&1 < vocab)))
      assert text == expected

      # As the serving's client decodes it.
      assert TextGeneration.Output.text!(tokenizer, ids, result.finish_reason, []) == text
    end

    test "max_len and timeout", %{tokenizer: tokenizer, state: state} do
      assert %{results: [%{finish_reason: :max_len}]} =
               TextGeneration.run(tokenizer, state, @plain_text, max_new_tokens: 16, max_len: 13)

      assert %{results: [%{finish_reason: :timeout, num_tokens: n}]} =
               TextGeneration.run(tokenizer, state, @plain_text,
                 max_new_tokens: 2000,
                 max_len: 4096,
                 ignore_eos: true,
                 timeout: 0,
                 chunk_size: 2
               )

      assert n in 1..3
    end

    test "a prompt longer than max_len raises EMLXAxon.Error", %{
      tokenizer: tokenizer,
      state: state
    } do
      assert_raise Error, ~r/prompt_too_long/, fn ->
        TextGeneration.run(tokenizer, state, @plain_text, max_len: 5)
      end
    end

    test "streams: option, mlx_stream and the process default", %{
      tokenizer: tokenizer,
      state: state
    } do
      expected = TextGeneration.run(tokenizer, state, @plain_text, @opts).results
      stream = EMLXAxon.Stream.new!(:cpu)

      assert TextGeneration.run(tokenizer, state, @plain_text, @opts ++ [stream: stream]).results ==
               expected

      assert TextGeneration.run(tokenizer, state, @plain_text, @opts ++ [mlx_stream: stream]).results ==
               expected

      assert EMLXAxon.Stream.with_stream(stream, fn ->
               TextGeneration.run(tokenizer, state, @plain_text, @opts).results
             end) == expected

      :ok = EMLXAxon.Stream.close(stream)

      assert_raise Error, ~r/closed_stream/, fn ->
        TextGeneration.run(tokenizer, state, @plain_text, @opts ++ [stream: stream])
      end

      assert_raise ArgumentError, ~r/stream\/5/, fn ->
        TextGeneration.run(tokenizer, state, @plain_text, stream: true)
      end

      assert_raise ArgumentError, ~r/either :stream or :mlx_stream/, fn ->
        TextGeneration.run(tokenizer, state, @plain_text, stream: stream, mlx_stream: stream)
      end
    end

    test "bad options raise ArgumentError", %{tokenizer: tokenizer, state: state} do
      for {opts, message} <- [
            {[max_new_tokens: 0], ~r/:max_new_tokens to be a positive integer, got: 0/},
            {[max_new_tokens: -3], ~r/:max_new_tokens/},
            {[max_len: -1], ~r/:max_len/},
            {[sampler: :nucleus], ~r/:sampler/},
            {[temperature: -1.0], ~r/:temperature/},
            {[top_p: 2], ~r/:top_p/},
            {[top_k: 1.5], ~r/:top_k/},
            {[min_p: -0.1], ~r/:min_p/},
            {[seed: "x"], ~r/:seed/},
            {[stop: [:x]], ~r/:stop/},
            {[chat: "yes"], ~r/:chat to be a boolean/},
            {[enable_thinking: 1], ~r/:enable_thinking/},
            {[timeout: :soon], ~r/:timeout/},
            {[profile_timing: "no"], ~r/:profile_timing/},
            {[stream: :yes], ~r/:stream/},
            {[mlx_stream: :cpu], ~r/:mlx_stream/},
            {[stream_done: true], ~r/unknown option :stream_done/},
            {[max_tokens: 10],
             ~r/unknown option :max_tokens for EMLXAxon.TextGeneration.run\/4, valid options are: :max_new_tokens, :max_len, :sampler/}
          ] do
        assert_raise ArgumentError, message, fn ->
          TextGeneration.run(tokenizer, state, "Hi", opts)
        end
      end
    end

    test "a quantized or rotating KV cache asks a serving for static batches" do
      config = EMLXAxon.TextGeneration.Config

      assert_raise ArgumentError, ~r/:kv_bits need static batches \(scheduler: false\)/, fn ->
        config.serving!(kv_bits: 8)
      end

      assert_raise ArgumentError, ~r/:kv_bits and :max_kv_size need static batches/, fn ->
        config.serving!(kv_bits: 8, max_kv_size: 64)
      end

      assert %{kv_bits: 8, scheduler: false} = config.serving!(kv_bits: 8, scheduler: false)
      assert %{max_kv_size: 64} = config.serving!(max_kv_size: 64, scheduler: false)

      # A cache dtype goes to the serving's own schedulers' slots.
      assert %{kv_dtype: :float16, scheduler: true, scheduler_options: [kv_dtype: :float16]} =
               config.serving!(kv_dtype: :float16)

      assert %{kv_dtype: :float16, scheduler: false} =
               config.serving!(kv_dtype: :float16, scheduler: false)
    end

    test "bad inputs raise ArgumentError", %{tokenizer: tokenizer, state: state} do
      for {input, message} <- [
            {[], ~r/empty list/},
            {"", ~r/empty string/},
            {%{text: ""}, ~r/empty string/},
            {%{input_ids: []}, ~r/empty prompt/},
            {%{input_ids: [-1]}, ~r/token ids/},
            {123, ~r/expected each input to be a string/},
            {%{prompt: "x"}, ~r/expected each input/},
            {%{text: "x", messages: @chat}, ~r/expected each input/},
            {%{seed: 1}, ~r/expected each input/},
            {["ok", 5], ~r/expected each input/},
            {[[%{role: "user"}]], ~r/expected each input/},
            {[%{role: "user", content: 1}], ~r/content a string/}
          ] do
        assert_raise ArgumentError, message, fn ->
          TextGeneration.run(tokenizer, state, input, @opts)
        end
      end

      assert_raise ArgumentError, ~r/EMLXAxon.Tokenizer/, fn ->
        TextGeneration.run(nil, state, "x")
      end

      assert_raise ArgumentError, ~r/a Bumblebee tokenizer/, fn ->
        TextGeneration.run(%{native_tokenizer: nil}, state, "x")
      end

      assert_raise ArgumentError, ~r/EMLXAxon.Qwen3.Model.State/, fn ->
        TextGeneration.run(tokenizer, nil, "x")
      end
    end
  end

  describe "stream/5" do
    test "chunks concatenate to run/4's text", %{tokenizer: tokenizer, state: state} do
      for input <- [@plain_text, @chat, "Hello"],
          opts <- [[], [chunk_size: 1], [chunk_size: 5]] do
        opts = [max_new_tokens: 24] ++ opts
        expected = TextGeneration.run(tokenizer, state, input, opts)
        parent = self()
        ref = make_ref()

        result = TextGeneration.stream(tokenizer, state, input, &send(parent, {ref, &1}), opts)
        chunks = collect(ref)

        assert result.results == expected.results
        assert Enum.all?(chunks, &(is_binary(&1) and &1 != "" and String.valid?(&1)))
        assert IO.iodata_to_binary(chunks) == hd(expected.results).generated_text
      end
    end

    test "a batch emits {index, chunk}", %{tokenizer: tokenizer, state: state} do
      inputs = [@plain_text, @chat, "Hello"]
      expected = TextGeneration.run(tokenizer, state, inputs, @opts)
      parent = self()
      ref = make_ref()

      result = TextGeneration.stream(tokenizer, state, inputs, &send(parent, {ref, &1}), @opts)
      chunks = collect(ref)

      assert Enum.map(result, & &1.results) == Enum.map(expected, & &1.results)

      for {output, index} <- Enum.with_index(expected) do
        text = for {^index, chunk} <- chunks, into: "", do: chunk
        assert text == hd(output.results).generated_text
      end
    end

    test "an exception in emit_fun propagates and the VM carries on", %{
      tokenizer: tokenizer,
      state: state
    } do
      assert_raise RuntimeError, "boom", fn ->
        TextGeneration.stream(tokenizer, state, @plain_text, fn _ -> raise "boom" end, @opts)
      end

      assert catch_throw(
               TextGeneration.stream(
                 tokenizer,
                 state,
                 @plain_text,
                 fn chunk -> throw({:stop, chunk}) end,
                 @opts
               )
             )
             |> elem(0) == :stop

      assert %{results: [%{num_tokens: 16}]} =
               TextGeneration.run(tokenizer, state, @plain_text, @opts)
    end

    test "bad emit_fun", %{tokenizer: tokenizer, state: state} do
      assert_raise ArgumentError, ~r/emit_fun/, fn ->
        TextGeneration.stream(tokenizer, state, "x", fn _, _ -> :ok end)
      end
    end
  end

  describe "Bumblebee and Tokenizers tokenizers" do
    # Where Bumblebee and `tokenizers` are not installed, stand-ins of the
    # same module names and struct shapes are used (test/support/foreign_tokenizers.ex).
    setup do
      file = Path.join(TestFixtures.path("qwen3-4bit-g64"), "tokenizer.json")
      native = ForeignTokenizers.native(file)
      %{native: native, bumblebee: ForeignTokenizers.bumblebee(native)}
    end

    test "run/4 and stream/5 take them and give the same results", %{
      tokenizer: tokenizer,
      state: state,
      native: native,
      bumblebee: bumblebee
    } do
      results = fn outputs -> Enum.map(outputs, & &1.results) end
      expected = TextGeneration.run(tokenizer, state, [@plain_text, "Hello"], @opts)

      for foreign <- [native, bumblebee] do
        assert results.(TextGeneration.run(foreign, state, [@plain_text, "Hello"], @opts)) ==
                 results.(expected)

        ref = make_ref()
        parent = self()
        TextGeneration.stream(foreign, state, "Hello", &send(parent, {ref, &1}), @opts)
        assert IO.iodata_to_binary(collect(ref)) == hd(Enum.at(expected, 1).results).text

        # tokenizer.json alone carries no chat template.
        assert_raise Error, ~r/chat_template/, fn ->
          TextGeneration.run(foreign, state, @chat, @opts)
        end
      end
    end

    test "with the checkpoint's directory, it is loaded from there, chat template included", %{
      native: native,
      bumblebee: bumblebee
    } do
      dir = TestFixtures.path("qwen3-4bit-g64")

      for foreign <- [native, bumblebee, nil] do
        tokenizer = TextGeneration.TokenizerSource.resolve!(foreign, dir)
        assert {:ok, %{has_chat_template: true}} = Tokenizer.info(tokenizer)
      end

      # Copies leave no files behind.
      copies = fn -> Path.wildcard(Path.join(System.tmp_dir!(), "emlx_axon_tokenizer_*")) end
      before = copies.()
      TextGeneration.TokenizerSource.resolve!(bumblebee)
      assert copies.() -- before == []
    end

    test "other structs are refused", %{state: state} do
      for other <- [%URI{}, %{native_tokenizer: nil}, %{__struct__: Foo, native_tokenizer: nil}] do
        assert_raise ArgumentError, ~r/a Bumblebee tokenizer/, fn ->
          TextGeneration.run(other, state, "x")
        end
      end
    end
  end

  describe "serving/3 and from_mlx4bit/3" do
    if Code.ensure_loaded?(Nx.Serving) do
      test "builds an Nx.Serving", %{tokenizer: tokenizer, state: state} do
        assert %{__struct__: Nx.Serving} = TextGeneration.serving(tokenizer, state, @opts)
      end
    else
      test "without Nx, raise an error saying how to add it", %{
        tokenizer: tokenizer,
        state: state
      } do
        assert_raise RuntimeError, ~r/add \{:nx, "~> 0.9"\}/, fn ->
          TextGeneration.serving(tokenizer, state, @opts)
        end

        assert_raise RuntimeError, ~r/add \{:nx, "~> 0.9"\}/, fn ->
          TextGeneration.from_mlx4bit(TestFixtures.path("qwen3-4bit-g64"), nil, @opts)
        end
      end
    end

    test "options are validated first", %{tokenizer: tokenizer, state: state} do
      assert_raise ArgumentError,
                   ~r/unknown option :bogus for EMLXAxon.TextGeneration.serving\/3/,
                   fn ->
                     TextGeneration.serving(tokenizer, state, bogus: 1)
                   end

      assert_raise ArgumentError, ~r/:max_new_tokens/, fn ->
        TextGeneration.from_mlx4bit(TestFixtures.path("qwen3-4bit-g64"), nil, max_new_tokens: 0)
      end

      assert_raise ArgumentError, ~r/:stream to be a boolean or an EMLXAxon.Stream/, fn ->
        TextGeneration.serving(tokenizer, state, stream: :maybe)
      end

      assert_raise ArgumentError, ~r/EMLXAxon.Tokenizer/, fn ->
        TextGeneration.serving(:tok, state)
      end

      for bad <- [
            [compile: [batch_size: 0]],
            [compile: [sequence_length: [16, -1]]],
            [compile: [batch_size: 2, jit: true]],
            [compile: :yes]
          ] do
        assert_raise ArgumentError, ~r/expected :compile to be a keyword list/, fn ->
          TextGeneration.serving(tokenizer, state, bad)
        end
      end

      assert_raise ArgumentError, ~r/:preallocate_params to be a boolean/, fn ->
        TextGeneration.serving(tokenizer, state, preallocate_params: "yes")
      end
    end

    test "Bumblebee's serving options are accepted", %{tokenizer: tokenizer, state: state} do
      opts = [
        compile: [batch_size: 2, sequence_length: [32, 128]],
        preallocate_params: true,
        defn_options: [max_concurrency: 1]
      ]

      if Code.ensure_loaded?(Nx.Serving) do
        assert %{__struct__: Nx.Serving, batch_size: 2} =
                 TextGeneration.serving(tokenizer, state, opts)
      else
        # Accepted: what fails is only the missing Nx.
        assert_raise RuntimeError, ~r/needs Nx/, fn ->
          TextGeneration.serving(tokenizer, state, opts)
        end
      end
    end
  end

  # run/4 raises what generation returns as an error; as a result, it can be
  # told apart from MLX's CUDA kernel compile failure.
  defp run_result(tokenizer, state, input, opts) do
    {:ok, TextGeneration.run(tokenizer, state, input, opts)}
  rescue
    error in Error -> {:error, error}
  end

  defp collect(ref, acc \\ []) do
    receive do
      {^ref, chunk} -> collect(ref, [chunk | acc])
    after
      0 -> Enum.reverse(acc)
    end
  end
end
