defmodule EMLXAxon.Qwen3.GenerateTest do
  use ExUnit.Case, async: true

  alias EMLXAxon.{Error, TestFixtures, Tokenizer}
  alias EMLXAxon.Qwen3.Generate

  @moduletag :fixtures

  # The references come from mlx-lm's generate_step, which does not stop at
  # EOS; ignore_eos keeps the comparison exact whatever the random model says.
  @parity [max_new_tokens: 16, ignore_eos: true]

  describe "greedy parity with mlx-lm" do
    for name <- TestFixtures.models(), prompt <- ["plain", "chat"] do
      test "#{name} (#{prompt} prompt)" do
        name = unquote(name)

        %{"prompt_ids" => prompt_ids, "greedy_ids" => greedy_ids} =
          TestFixtures.reference(name)["prompts"][unquote(prompt)]

        state = TestFixtures.model(name)
        result = Generate.generate(state, prompt_ids, @parity)

        assert {:ok, %{token_ids: ^greedy_ids, finish_reason: :length, timings: timings}} = result

        assert %{prompt_tokens: prompt_tokens, generated_tokens: 16, batch_size: 1} = timings
        assert prompt_tokens == length(prompt_ids)
      end
    end

    # mlx-lm's reference ran on the CPU. On a GPU the products round
    # differently (an NVIDIA H200 agreed on the first 8 of 16 ids): there the
    # ids must follow the reference until a step where our pick is still
    # among its top 4; on the CPU they must match exactly.
    test "qwen3-bf16 quantized while loading matches mlx-lm's quantized model" do
      state = TestFixtures.model("qwen3-bf16", quantize: [bits: 4, group_size: 128])

      for {_prompt, %{"prompt_ids" => prompt_ids, "greedy_ids" => greedy, "top_ids" => top_ids}} <-
            TestFixtures.reference("qwen3-bf16", "reference_q4g128")["prompts"] do
        ids = ids!(Generate.generate(state, prompt_ids, @parity))
        assert_follows_reference(ids, greedy, top_ids)
      end
    end

    # Where users are: the default dtype, bfloat16 on a GPU. Its greedy ids
    # follow float32's until a step where float32's top two are close; there
    # the bfloat16 pick must still be one of float32's top 4. On the CPU the
    # default is float32 and the ids must match exactly.
    for name <- TestFixtures.models(), prompt <- ["plain", "chat"] do
      test "#{name} (#{prompt} prompt) in the default dtype" do
        name = unquote(name)

        %{"prompt_ids" => prompt_ids, "greedy_ids" => greedy, "top_ids" => top_ids} =
          TestFixtures.reference(name)["prompts"][unquote(prompt)]

        state = TestFixtures.model(name, dtype: nil)
        ids = ids!(Generate.generate(state, prompt_ids, @parity))

        if ids != greedy do
          assert state.config.dtype == "bfloat16",
                 "ids #{inspect(ids)} differ from #{inspect(greedy)}"
        end

        assert_follows_reference(ids, greedy, top_ids)
      end
    end
  end

  # Equal to the reference's greedy ids on the CPU; on a GPU equal up to a
  # step where our pick is still among the reference's top 4.
  defp assert_follows_reference(ids, greedy, top_ids) do
    case Enum.find_index(Enum.zip(ids, greedy), fn {a, b} -> a != b end) do
      nil ->
        :ok

      step ->
        assert TestFixtures.gpu?(), "ids #{inspect(ids)} differ from #{inspect(greedy)}"

        assert Enum.at(ids, step) in Enum.take(Enum.at(top_ids, step), 4),
               "step #{step}: #{Enum.at(ids, step)} is not in the reference's top 4"
    end
  end

  defp ids!(result) do
    assert {:ok, %{token_ids: ids}} = result
    ids
  end

  describe "float32 on every device" do
    # On CUDA, the first prefill of 8 or more tokens compiled MLX's CUTLASS
    # quantized kernel on the calling dirty scheduler thread, whose stack it
    # overflowed: the VM died. Each prompt length here is a new shape.
    # In qwen3-4bit-g128 one quantization group spans a whole input row:
    # MLX's CUDA backend has its own kernel for such products, which the
    # engine does not use (see layers.rs); every length, and a batch, must
    # still run.
    for name <- ["qwen3-4bit-g64", "qwen3-4bit-g128"] do
      test "#{name}: prompts of 1 to 24 tokens, alone and batched" do
        name = unquote(name)
        state = TestFixtures.model(name)
        %{"prompt_ids" => ids} = TestFixtures.reference(name)["prompts"]["chat"]
        ids = Stream.cycle(ids) |> Enum.take(24)

        for n <- 1..24 do
          assert {:ok, %{token_ids: [_, _]}} =
                   Generate.generate(state, Enum.take(ids, n), max_new_tokens: 2, ignore_eos: true)
        end

        assert {:ok, [%{token_ids: [_, _]}, %{token_ids: [_, _]}]} =
                 Generate.generate(state, [Enum.take(ids, 3), Enum.take(ids, 17)],
                   max_new_tokens: 2,
                   ignore_eos: true
                 )
      end
    end
  end

  describe "batches" do
    test "each row of a batch equals its single run" do
      state = TestFixtures.model("qwen3-4bit-g64")
      prompts = TestFixtures.reference("qwen3-4bit-g64")["prompts"]
      plain = prompts["plain"]
      chat = prompts["chat"]

      assert {:ok, [first, second, third]} =
               Generate.generate(
                 state,
                 [plain["prompt_ids"], chat["prompt_ids"], plain["prompt_ids"]],
                 @parity
               )

      assert first.token_ids == plain["greedy_ids"]
      assert second.token_ids == chat["greedy_ids"]
      assert third.token_ids == plain["greedy_ids"]
      assert Enum.map([first, second, third], & &1.timings.batch_size) == [3, 3, 3]
      assert first.timings.prompt_tokens == length(plain["prompt_ids"])
      assert second.timings.prompt_tokens == length(chat["prompt_ids"])
    end

    test "a batch of one list is a batch" do
      state = TestFixtures.model("qwen3-4bit-g64")

      %{"prompt_ids" => ids, "greedy_ids" => greedy} =
        TestFixtures.reference("qwen3-4bit-g64")["prompts"]["plain"]

      assert {:ok, [%{token_ids: ^greedy}]} = Generate.generate(state, [ids], @parity)
    end

    test "rows stop independently" do
      state = TestFixtures.model("qwen3-4bit-g64")

      %{"prompt_ids" => ids, "greedy_ids" => greedy} =
        TestFixtures.reference("qwen3-4bit-g64")["prompts"]["plain"]

      # Row 0 stops when it produces greedy[3] (made an EOS token); row 1 has a
      # prompt too long to get there before max_len.
      eos = Enum.at(greedy, 3)
      stop_at = Enum.find_index(greedy, &(&1 == eos))

      assert {:ok, [short, long]} =
               Generate.generate(state, [ids, ids ++ greedy],
                 max_new_tokens: 16,
                 eos_token_ids: [eos],
                 max_len: length(ids) + 16 + 2
               )

      assert short.finish_reason == :eos
      assert short.token_ids == Enum.take(greedy, stop_at + 1)
      assert long.finish_reason in [:max_len, :eos]
    end
  end

  describe "options" do
    setup do
      state = TestFixtures.model("qwen3-4bit-g64")

      %{"prompt_ids" => ids, "greedy_ids" => greedy} =
        TestFixtures.reference("qwen3-4bit-g64")["prompts"]["plain"]

      %{state: state, ids: ids, greedy: greedy}
    end

    test "max_new_tokens", %{state: state, ids: ids, greedy: greedy} do
      assert {:ok, %{token_ids: tokens, finish_reason: :length}} =
               Generate.generate(state, ids, max_new_tokens: 5, ignore_eos: true)

      assert tokens == Enum.take(greedy, 5)
    end

    test "on_chunk sees the first token alone, then every chunk, in the caller",
         %{state: state, ids: ids, greedy: greedy} do
      caller = self()
      on_chunk = fn rows -> send(caller, {:chunk, self(), rows}) end

      assert {:ok, [%{token_ids: first}, %{token_ids: second}]} =
               Generate.generate(state, [ids, ids],
                 max_new_tokens: 9,
                 ignore_eos: true,
                 chunk_size: 4,
                 on_chunk: on_chunk
               )

      chunks = collect_chunks([])
      assert Enum.all?(chunks, fn {pid, _rows} -> pid == caller end)
      rows = Enum.map(chunks, fn {_pid, rows} -> rows end)
      assert [[%{ids: [_]}, %{ids: [_]}] | _] = rows
      assert Enum.map(rows, fn [a, _b] -> length(a.ids) end) == [1, 4, 4]
      assert first == Enum.take(greedy, 9) and second == first
      assert Enum.flat_map(rows, fn [a, _b] -> a.ids end) == first
      assert [%{finish_reason: :length}, %{finish_reason: :length}] = List.last(rows)

      assert_raise ArgumentError, ~r/:on_chunk to be a function of one argument/, fn ->
        Generate.generate(state, ids, on_chunk: fn -> :ok end)
      end
    end

    test "max_len stops with :max_len", %{state: state, ids: ids, greedy: greedy} do
      assert {:ok, %{token_ids: tokens, finish_reason: :max_len}} =
               Generate.generate(state, ids,
                 max_new_tokens: 16,
                 max_len: length(ids) + 3,
                 ignore_eos: true
               )

      assert tokens == Enum.take(greedy, length(tokens))
      assert length(tokens) in 3..4
    end

    test "a prompt longer than max_len is an error", %{state: state, ids: ids} do
      assert {:error, %Error{kind: :prompt_too_long}} = Generate.generate(state, ids, max_len: 4)

      assert {:error, %Error{kind: :prompt_too_long}} =
               Generate.generate(state, ids, max_len: length(ids))
    end

    test "eos_token_ids and ignore_eos", %{state: state, ids: ids, greedy: greedy} do
      eos = Enum.at(greedy, 2)
      stop_at = Enum.find_index(greedy, &(&1 == eos))

      assert {:ok, %{token_ids: tokens, finish_reason: :eos}} =
               Generate.generate(state, ids, eos_token_ids: [eos], max_new_tokens: 16)

      assert tokens == Enum.take(greedy, stop_at + 1)

      assert {:ok, %{token_ids: ^greedy, finish_reason: :length}} =
               Generate.generate(state, ids,
                 eos_token_ids: eos,
                 ignore_eos: true,
                 max_new_tokens: 16
               )
    end

    test "top_k: 1 equals greedy", %{state: state, ids: ids, greedy: greedy} do
      for sampler <- [:top_p_cpu, :top_p_gpu] do
        assert {:ok, %{token_ids: ^greedy}} =
                 Generate.generate(state, ids, @parity ++ [sampler: sampler, top_k: 1, seed: 3])
      end
    end

    test "seeded sampling is reproducible", %{state: state, ids: ids} do
      for sampler <- [:top_p_cpu, :top_p_gpu] do
        opts = @parity ++ [sampler: sampler, top_p: 0.95, temperature: 1.5, seed: 1234]
        assert {:ok, %{token_ids: first}} = Generate.generate(state, ids, opts)
        assert {:ok, %{token_ids: ^first}} = Generate.generate(state, ids, opts)
        assert length(first) == 16
      end
    end

    test "different seeds give different samples", %{state: state, ids: ids} do
      opts = @parity ++ [sampler: :top_p_cpu, top_p: 1.0, temperature: 5.0]

      samples =
        for seed <- 1..4,
            do: elem(Generate.generate(state, ids, opts ++ [seed: seed]), 1).token_ids

      assert length(Enum.uniq(samples)) > 1
    end

    test "min_p near 1 keeps only the most likely token", %{
      state: state,
      ids: ids,
      greedy: greedy
    } do
      assert {:ok, %{token_ids: ^greedy}} =
               Generate.generate(
                 state,
                 ids,
                 @parity ++ [sampler: :top_p_cpu, min_p: 0.999, seed: 9]
               )
    end

    test "stop strings need a tokenizer and end generation", %{
      state: state,
      ids: ids,
      greedy: greedy
    } do
      assert_raise ArgumentError, ~r/needs a tokenizer/, fn ->
        Generate.generate(state, ids, stop: "x")
      end

      tokenizer = TestFixtures.tokenizer()
      {:ok, full} = Generate.generate(state, ids, @parity ++ [tokenizer: tokenizer])
      assert full.token_ids == greedy
      assert {:ok, full_text} = Tokenizer.decode(tokenizer, greedy)
      assert full.text == full_text

      # Stop on the text that the (k+1)th token adds.
      {k, prefix, stop} = TestFixtures.stop_string(tokenizer, greedy)

      assert {:ok, %{finish_reason: :stop, token_ids: tokens, text: text}} =
               Generate.generate(
                 state,
                 ids,
                 @parity ++ [tokenizer: tokenizer, stop: [stop, "never ☃"]]
               )

      assert tokens == Enum.take(greedy, k + 1)
      assert text == prefix
    end

    test "profile_timing", %{state: state, ids: ids} do
      assert {:ok, %{timings: timings}} =
               Generate.generate(state, ids, max_new_tokens: 8, profile_timing: true)

      assert %{
               prefill_ms: prefill,
               decode_ms: decode,
               decode_tokens_per_s: tps,
               time_to_first_token_ms: ttft,
               total_ms: total
             } = timings

      assert prefill > 0 and decode > 0 and tps > 0 and ttft > 0 and total > 0

      # Without profiling only the counts and Elixir's wall clock are there.
      assert {:ok, %{timings: timings}} =
               Generate.generate(state, ids, max_new_tokens: 8, profile_timing: false)

      assert %{
               prefill_ms: +0.0,
               decode_ms: +0.0,
               decode_tokens_per_s: +0.0,
               time_to_first_token_ms: +0.0,
               generated_tokens: 8,
               total_ms: total
             } = timings

      assert total > 0
    end

    test "temperature 0 is greedy decoding", %{state: state, ids: ids, greedy: greedy} do
      for sampler <- [:top_p_cpu, :top_p_gpu] do
        assert {:ok, %{token_ids: ^greedy}} =
                 Generate.generate(state, ids, @parity ++ [sampler: sampler, temperature: 0])
      end
    end

    test "chunk_size does not change the result", %{state: state, ids: ids, greedy: greedy} do
      for chunk_size <- [1, 3, 64] do
        assert {:ok, %{token_ids: ^greedy}} =
                 Generate.generate(state, ids, @parity ++ [chunk_size: chunk_size])
      end
    end

    test "timeout stops generation with :timeout", %{state: state, ids: ids} do
      assert {:ok, %{finish_reason: :timeout, token_ids: tokens}} =
               Generate.generate(state, ids,
                 max_new_tokens: 1000,
                 max_len: 4096,
                 ignore_eos: true,
                 timeout: 0,
                 chunk_size: 1
               )

      assert length(tokens) >= 1 and length(tokens) < 1000
    end

    test "stream option and the process default stream", %{state: state, ids: ids, greedy: greedy} do
      stream = EMLXAxon.Stream.new(:cpu)

      assert {:ok, %{token_ids: ^greedy}} =
               Generate.generate(state, ids, @parity ++ [stream: stream])

      assert {:ok, %{token_ids: ^greedy}} =
               EMLXAxon.Stream.with_stream(stream, fn ->
                 Generate.generate(state, ids, @parity)
               end)

      :ok = EMLXAxon.Stream.close(stream)

      assert {:error, %Error{kind: :closed_stream}} =
               Generate.generate(state, ids, @parity ++ [stream: stream])

      assert {:error, %Error{kind: :closed_stream}} =
               EMLXAxon.Stream.with_stream(stream, fn ->
                 Generate.generate(state, ids, @parity)
               end)
    end

    # Its values against mlx-lm's QuantizedKVCache are the engine's tests
    # (native/engine/tests/kv_caches.rs); here, that the options arrive and
    # that the path taken is reported: the CPU layer nodes read 8-bit caches,
    # other fused layers step aside and say so.
    test "kv_bits quantizes the KV cache, and the path says who read it",
         %{state: state, ids: ids} do
      opts = [max_new_tokens: 8, ignore_eos: true, kv_group_size: 32, quantized_kv_start: 0]

      assert {:ok, %{token_ids: plain, timings: plain_timings}} =
               Generate.generate(state, ids, opts)

      quantized = "the KV cache is quantized"
      refute Enum.any?(plain_timings.fallbacks || [], &String.contains?(&1, quantized))

      assert {:ok, %{token_ids: ids8, timings: timings}} =
               Generate.generate(state, ids, [kv_bits: 8] ++ opts)

      assert length(ids8) == length(plain)

      if plain_timings.decode_path == "cpu_layers" do
        assert timings.decode_path == "cpu_layers"
        refute Enum.any?(timings.fallbacks || [], &String.contains?(&1, quantized))
      else
        assert Enum.any?(timings.fallbacks, &String.contains?(&1, quantized))
      end
    end

    test "max_kv_size keeps a rotating window: the fused layers say they stepped aside",
         %{state: state, ids: ids} do
      opts = [max_new_tokens: 24, ignore_eos: true, max_kv_size: 16]
      assert {:ok, %{token_ids: window, timings: timings}} = Generate.generate(state, ids, opts)
      assert length(window) == 24
      assert Enum.any?(timings.fallbacks, &String.contains?(&1, "rotating window"))

      assert {:error, %Error{kind: :invalid_argument, message: message}} =
               Generate.generate(state, ids, max_kv_size: 4)

      assert message =~ "max_kv_size must be more than 4"
    end

    # Its logits against MLX's ops over the same cache are the engine's
    # tests (native/engine/tests/kv_dtype.rs); here, that the option arrives.
    test "kv_dtype keeps the KV cache in float16; not with kv_bits", %{state: state, ids: ids} do
      opts = [max_new_tokens: 8, ignore_eos: true]

      assert {:ok, %{token_ids: half, timings: timings}} =
               Generate.generate(state, ids, [kv_dtype: :float16] ++ opts)

      assert length(half) == 8
      assert is_binary(timings.decode_path)

      assert {:error, %Error{kind: :invalid_argument, message: message}} =
               Generate.generate(
                 state,
                 ids,
                 [kv_dtype: :float16, kv_bits: 8, kv_group_size: 32] ++ opts
               )

      assert message =~ "kv_dtype and kv_bits cannot be combined"
    end

    test "a KV group size the model's heads cannot take is an error naming it",
         %{state: state, ids: ids} do
      # The fixture's heads are 32 values wide.
      assert {:error, %Error{kind: :invalid_argument, message: message}} =
               Generate.generate(state, ids, max_new_tokens: 2, kv_bits: 8, kv_group_size: 64)

      assert message =~ "kv_group_size (64) must divide the model's head size (32)"
    end

    test "bad options raise ArgumentError", %{state: state, ids: ids} do
      bad = [
        {[max_new_tokens: 0], ~r/:max_new_tokens to be a positive integer/},
        {[max_new_tokens: -1], ~r/:max_new_tokens to be a positive integer/},
        {[max_new_tokens: 1.5], ~r/:max_new_tokens to be a positive integer/},
        {[max_len: 0], ~r/:max_len to be a positive integer/},
        {[sampler: :beam], ~r/:sampler to be one of :greedy, :top_p_cpu, :top_p_gpu/},
        {[temperature: -1], ~r/:temperature to be a number >= 0/},
        {[temperature: "hot"], ~r/:temperature/},
        {[top_p: 0], ~r/:top_p/},
        {[top_p: 1.5], ~r/:top_p/},
        {[top_k: -1], ~r/:top_k/},
        {[min_p: 1.0], ~r/:min_p/},
        {[seed: -1], ~r/:seed/},
        {[stop: [""]], ~r/:stop/},
        {[stop: 5], ~r/:stop/},
        {[eos_token_ids: [-1]], ~r/:eos_token_ids/},
        {[ignore_eos: 1], ~r/:ignore_eos to be a boolean/},
        {[profile_timing: nil], ~r/:profile_timing to be a boolean/},
        {[stream: :gpu], ~r/:stream to be an EMLXAxon.Stream/},
        {[timeout: -5], ~r/:timeout/},
        {[chunk_size: 0], ~r/:chunk_size/},
        {[tokenizer: "x"], ~r/:tokenizer/},
        {[kv_bits: 7], ~r/:kv_bits to be nil or one of 2, 3, 4, 5, 6, 8/},
        {[kv_group_size: 48], ~r/:kv_group_size to be one of 32, 64, 128/},
        {[quantized_kv_start: -1], ~r/:quantized_kv_start to be a non-negative integer/},
        {[max_kv_size: 0], ~r/:max_kv_size to be nil or a positive integer/},
        {[kv_dtype: :int8], ~r/:kv_dtype to be nil or one of :float32, :bfloat16, :float16/},
        {[bogus: 1],
         ~r/unknown option :bogus for EMLXAxon.Qwen3.Generate.generate\/3, valid options are: :max_new_tokens/},
        {:not_a_list, ~r/keyword list/}
      ]

      for {opts, message} <- bad do
        assert_raise ArgumentError, message, fn -> Generate.generate(state, ids, opts) end
      end
    end

    test "bad inputs raise ArgumentError", %{state: state, ids: ids} do
      assert_raise ArgumentError, ~r/non-empty list of token ids/, fn ->
        Generate.generate(state, [])
      end

      assert_raise ArgumentError, ~r/empty prompt/, fn -> Generate.generate(state, [ids, []]) end

      assert_raise ArgumentError, ~r/token ids to be integers from 0 to 151935/, fn ->
        Generate.generate(state, [1, -1])
      end

      assert_raise ArgumentError, ~r/token ids to be integers/, fn ->
        Generate.generate(state, [151_936])
      end

      assert_raise ArgumentError, ~r/token ids to be integers/, fn ->
        Generate.generate(state, ["a"])
      end

      assert_raise ArgumentError, ~r/non-empty list of token ids/, fn ->
        Generate.generate(state, "hello")
      end

      assert_raise ArgumentError, ~r/EMLXAxon.Qwen3.Model.State/, fn ->
        Generate.generate(:state, ids)
      end
    end
  end

  defp collect_chunks(acc) do
    receive do
      {:chunk, pid, rows} -> collect_chunks([{pid, rows} | acc])
    after
      0 -> Enum.reverse(acc)
    end
  end
end
