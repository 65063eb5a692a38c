defmodule EMLXAxon.ResultTest do
  # One result shape, documented in EMLXAxon.Result, across
  # EMLXAxon.Qwen3.Generate, EMLXAxon.TextGeneration and EMLXAxon.Scheduler.
  use ExUnit.Case, async: false

  alias EMLXAxon.{Scheduler, TestFixtures, TextGeneration}
  alias EMLXAxon.Qwen3.Generate
  alias EMLXAxon.TextGeneration.Serving.Results

  @result_keys [:text, :generated_text, :token_ids, :num_tokens, :finish_reason, :token_summary]
  @metadata_keys [
    :prompt_tokens,
    :generated_tokens,
    :batch_size,
    :prefill_ms,
    :decode_ms,
    :decode_tokens_per_s,
    :time_to_first_token_ms,
    :total_ms,
    :decode_path,
    :prefill_path,
    :fallbacks,
    :kv_dtype
  ]
  @scheduler_keys [:queue_ms, :cached_tokens, :constraint_ms]

  @prompt [785, 6722, 315, 9625, 374]
  @opts [max_new_tokens: 6, ignore_eos: true]

  defp assert_result(result, ids, prompt_tokens) do
    for key <- @result_keys, do: assert(Map.has_key?(result, key), "#{key} missing")
    assert result.token_ids == ids
    assert result.num_tokens == length(ids)
    assert result.text == result.generated_text
    assert result.finish_reason == :length
    assert result.token_summary == %{input: prompt_tokens, output: length(ids), padding: 0}
  end

  defp assert_metadata(metadata, native_stats, prompt_tokens, generated) do
    for key <- @metadata_keys, do: assert(Map.has_key?(metadata, key), "#{key} missing")
    assert metadata.prompt_tokens == prompt_tokens
    assert metadata.generated_tokens == generated
    assert metadata.batch_size == 1
    assert is_float(metadata.total_ms) and metadata.total_ms > 0
    TestFixtures.assert_paths(metadata, native_stats)
  end

  describe "the three APIs" do
    @describetag :fixtures

    setup do
      %{state: TestFixtures.model("qwen3-4bit-g64"), tokenizer: TestFixtures.tokenizer()}
    end

    test "give the same tokens under the same keys", %{state: state, tokenizer: tokenizer} do
      native_stats = TestFixtures.native_stats(state)

      {:ok, direct} = Generate.generate(state, @prompt, [tokenizer: tokenizer] ++ @opts)
      ids = direct.token_ids
      assert length(ids) == 6
      assert_result(direct, ids, 5)
      assert_metadata(direct.metadata, native_stats, 5, 6)
      # The older name of the same map.
      assert direct.timings == direct.metadata

      %{results: [result], metadata: metadata} =
        TextGeneration.run(tokenizer, state, %{input_ids: @prompt}, @opts)

      assert_result(result, ids, 5)
      assert_metadata(metadata, native_stats, 5, 6)
      assert result.text == direct.text
      # A TextGeneration result is timing-free; its metadata sits beside it.
      refute Map.has_key?(result, :metadata)

      server = start_supervised!({Scheduler, model: state, tokenizer: tokenizer})
      {:ok, scheduled} = Scheduler.generate(server, @prompt, @opts)
      assert_result(scheduled, ids, 5)
      assert scheduled.ids == ids
      assert scheduled.text == direct.text
      # The scheduler's own stats name its paths where the engine reports them.
      assert_metadata(scheduled.metadata, scheduled.stats, 5, 6)
      for key <- @scheduler_keys, do: assert(Map.has_key?(scheduled.metadata, key))
      assert scheduled.metadata.prompt_tokens == scheduled.stats.prompt_tokens

      %{results: [via], metadata: via_metadata} =
        TextGeneration.run(tokenizer, state, %{input_ids: @prompt}, [scheduler: server] ++ @opts)

      assert_result(via, ids, 5)
      assert_metadata(via_metadata, scheduled.stats, 5, 6)
    end

    test "a batch's results are padded to its longest prompt", %{state: state} do
      {:ok, [short, long]} = Generate.generate(state, [[1, 2], [1, 2, 3, 4]], @opts)
      assert short.token_summary == %{input: 2, output: 6, padding: 2}
      assert long.token_summary == %{input: 4, output: 6, padding: 0}
      assert short.metadata.batch_size == 2
    end

    test "a scheduler request that times out still has its metadata", %{state: state} do
      server = start_supervised!({Scheduler, model: state})

      {:ok, result} =
        Scheduler.generate(server, @prompt, max_new_tokens: 1000, ignore_eos: true, timeout: 0)

      assert result.finish_reason == :timeout
      assert result.token_summary.input == 5
      assert result.metadata.prompt_tokens == 5

      assert %{decode_path: nil, prefill_path: nil, fallbacks: nil, kv_dtype: nil} =
               result.metadata
    end
  end

  describe "a serving's results" do
    # As an execution encodes them, and a caller decodes its rows.
    defp stats(paths) do
      Map.merge(
        %{
          prompt_tokens: [3, 5],
          generated_tokens: [2, 1],
          forced_tokens: [1, 0],
          prefill_ms: 1.0,
          decode_ms: 2.0,
          decode_tokens_per_s: 3.0,
          time_to_first_token_ms: 4.0,
          total_ms: 5.0
        },
        paths
      )
    end

    @rows [
      %{ids: [7, 8], text: "", finish_reason: :length},
      %{ids: [9], text: "", finish_reason: :eos}
    ]

    test "carry the engine paths, the KV dtype and forced tokens" do
      paths = %{
        decode_path: "cuda_replay",
        prefill_path: "mlx",
        fallbacks: ["no graph", "é"],
        kv_dtype: :bfloat16
      }

      fields = Results.encode(@rows, stats(paths), 4)
      binaries = Map.new(fields, fn {name, {_type, _shape, binary}} -> {name, binary} end)

      [first, second] = Results.decode(binaries, 4)
      assert Map.take(first.metadata, Map.keys(paths)) == paths
      assert Map.take(second.metadata, Map.keys(paths)) == paths
      assert {first.metadata.forced_tokens, second.metadata.forced_tokens} == {1, 0}

      none = %{decode_path: nil, prefill_path: nil, fallbacks: nil}
      fields = Results.encode(@rows, stats(none), 4)
      binaries = Map.new(fields, fn {name, {_type, _shape, binary}} -> {name, binary} end)

      assert [%{metadata: %{decode_path: nil, fallbacks: nil, kv_dtype: nil}}, _] =
               Results.decode(binaries, 4)

      # As the engine reports it: a binary.
      fields = Results.encode(@rows, stats(%{kv_dtype: "float16"}), 4)
      binaries = Map.new(fields, fn {name, {_type, _shape, binary}} -> {name, binary} end)
      assert [%{metadata: %{kv_dtype: :float16}}, _] = Results.decode(binaries, 4)
    end

    test "keep one row width whatever the fallbacks, dropping what does not fit" do
      many = for i <- 1..200, do: "fallback reason number #{i}"
      paths = %{decode_path: "cpu_layers", prefill_path: "cpu_layers", fallbacks: many}
      fields = Results.encode(@rows, stats(paths), 4)
      assert {{:u, 8}, {2, width}, _} = fields.paths
      assert {{:u, 8}, {2, ^width}, _} = Results.encode(@rows, stats(%{}), 4).paths

      binaries = Map.new(fields, fn {name, {_type, _shape, binary}} -> {name, binary} end)
      [%{metadata: metadata}, _] = Results.decode(binaries, 4)
      assert metadata.decode_path == "cpu_layers"
      assert [_ | _] = metadata.fallbacks
      assert metadata.fallbacks == Enum.take(many, length(metadata.fallbacks))
      assert length(metadata.fallbacks) < 200
    end
  end
end
