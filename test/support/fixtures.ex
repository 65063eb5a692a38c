defmodule EMLXAxon.TestFixtures do
  @moduledoc false
  # Paths to, and cached loads of, the test fixtures that scripts/setup
  # builds in .cache/fixtures (tiny random Qwen checkpoints with mlx-lm
  # reference outputs).

  alias EMLXAxon.{Tokenizer}
  alias EMLXAxon.Qwen3.Loader

  @root Path.expand("../..", __DIR__)
  @fixtures Path.join(@root, ".cache/fixtures")

  @models ~w(qwen3-4bit-g64 qwen3-4bit-g128 qwen3-bf16 qwen3-mixed qwen2-4bit-g64)

  def root, do: @root
  def fixtures_dir, do: @fixtures
  def models, do: @models
  def path(name), do: Path.join(@fixtures, name)
  def tokenizer_dir, do: Path.join(@root, ".cache/tokenizer-qwen3")

  @doc "A complete options map for `EMLXAxon.Native.generation_start/5`: greedy, EOS ignored."
  def native_opts(overrides \\ %{}) do
    Map.merge(
      %{
        max_new_tokens: 2,
        max_len: 64,
        sampler: :greedy,
        temperature: 1.0,
        top_p: 1.0,
        top_k: 0,
        min_p: 0.0,
        seed: nil,
        stop: [],
        eos_token_ids: nil,
        ignore_eos: true,
        profile_timing: false,
        kv_bits: nil,
        kv_group_size: 64,
        quantized_kv_start: 5000,
        max_kv_size: nil,
        kv_dtype: nil
      },
      overrides
    )
  end

  def available? do
    File.regular?(Path.join(@fixtures, "chat_renders.exs")) and
      Enum.all?(@models, &File.regular?(Path.join(path(&1), "reference.exs")))
  end

  @doc "The fixture's reference map (`reference.exs` or another stem)."
  def reference(name, stem \\ "reference") do
    cached({:reference, name, stem}, fn -> eval!(Path.join(path(name), stem <> ".exs")) end)
  end

  def chat_renders,
    do: cached(:chat_renders, fn -> eval!(Path.join(@fixtures, "chat_renders.exs")) end)

  def encodings, do: cached(:encodings, fn -> eval!(Path.join(@fixtures, "encodings.exs")) end)

  @doc """
  A loaded model state, shared by all tests (loaded once). It computes in
  float32 unless `opts` say otherwise: the references are mlx-lm's float32
  outputs, and the default dtype is bfloat16 on a GPU, where greedy ids may
  part from float32 ones after a few tokens.
  """
  def model(name, opts \\ []) do
    opts = Keyword.put_new(opts, :dtype, :float32)
    cached({:model, name, opts}, fn -> Loader.load!(path(name), opts) end)
  end

  @doc "The device MLX computes on by default here: `:cpu` or `:gpu`."
  def device do
    cached(:device, fn ->
      # Without the NIF every test fails and says why; this must not raise.
      if EMLXAxon.Native.load_error(), do: :cpu, else: EMLXAxon.Native.mlx_info().default_device
    end)
  end

  def gpu?, do: device() == :gpu

  @doc """
  On a GPU, compiles MLX's CUDA kernels for the fixtures before the tests:
  MLX compiles each kernel on first use (minutes for these fixtures on a
  fresh machine, cached on disk after), which would otherwise land in
  whichever tests come first, several at once, and can pass ExUnit's
  timeout. It runs the reference prompts alone and batched, in float32 and
  the default dtype, greedy and sampled. Does nothing on the CPU.
  """
  def warm_up do
    if available?() and gpu?() do
      started = System.monotonic_time(:millisecond)

      loads =
        for name <- @models, dtype <- [:float32, nil] do
          {name, [dtype: dtype]}
        end

      for {name, opts} <- loads ++ [{"qwen3-bf16", [quantize: [bits: 4, group_size: 128]]}],
          {:ok, state} <- [Loader.load(path(name), Keyword.put_new(opts, :dtype, :float32))] do
        %{"plain" => %{"prompt_ids" => plain}, "chat" => %{"prompt_ids" => chat}} =
          reference(name)["prompts"]

        samplers = [
          [],
          [sampler: :top_p_cpu, top_p: 0.9, seed: 1],
          [sampler: :top_p_gpu, top_p: 0.9, top_k: 20, min_p: 0.05, seed: 1]
        ]

        for prompts <- [plain, chat, [plain, chat, plain], Enum.take(plain, 3)],
            sampler <- samplers do
          opts = [max_new_tokens: 4, ignore_eos: true] ++ sampler
          EMLXAxon.Qwen3.Generate.generate(state, prompts, opts)
        end
      end

      ms = System.monotonic_time(:millisecond) - started
      IO.puts("Compiled MLX's GPU kernels for the fixtures in #{ms} ms.")
    end

    :ok
  end

  @doc "The tokenizer of a fixture, shared by all tests."
  def tokenizer(name \\ "qwen3-4bit-g64") do
    cached({:tokenizer, name}, fn -> Tokenizer.load!(path(name)) end)
  end

  @doc """
  A stop string for greedy output `ids`: `{k, text_before, stop}` where the
  text of `ids`' first k tokens is `text_before` and token k + 1 adds
  `stop`, found nowhere earlier.
  """
  def stop_string(tokenizer, ids) do
    Enum.find_value(2..(length(ids) - 1), fn k ->
      {:ok, before} = EMLXAxon.Tokenizer.decode(tokenizer, Enum.take(ids, k))
      {:ok, now} = EMLXAxon.Tokenizer.decode(tokenizer, Enum.take(ids, k + 1))

      with true <- String.starts_with?(now, before) and not String.contains?(now, "\uFFFD"),
           piece = binary_part(now, byte_size(before), byte_size(now) - byte_size(before)),
           true <- String.trim(piece) != "",
           true <- :binary.match(now, piece) == {byte_size(before), byte_size(piece)} do
        {k, before, piece}
      else
        _ -> nil
      end
    end) || ExUnit.Assertions.flunk("no usable stop string in #{inspect(ids)}")
  end

  defp eval!(file) do
    {term, _binding} = Code.eval_file(file)
    term
  end

  @doc """
  The stats map `EMLXAxon.Native.generation_stats/1` gives for a short
  greedy generation on `state`, as the engine reports it (before any
  Elixir code reads it).
  """
  def native_stats(state) do
    alias EMLXAxon.{Error, Native}

    {:ok, generation} =
      Error.wrap(Native.generation_start(state.ref, nil, nil, [[1, 2, 3]], native_opts()))

    try do
      finish = fn finish ->
        case Error.wrap(Native.generation_next(generation, 4)) do
          {:ok, {:done, _chunk}} -> :ok
          {:ok, {_running, _chunk}} -> finish.(finish)
        end
      end

      finish.(finish)
      {:ok, stats} = Error.wrap(Native.generation_stats(generation))
      stats
    after
      Native.generation_free(generation)
    end
  end

  @doc """
  Asserts that `metadata` (of a result or an event) names the engine paths
  that ran: `:decode_path` and `:prefill_path` binaries and `:fallbacks` a
  list of binaries; and `:kv_dtype`, the KV cache's dtype as an atom. An
  engine whose stats (`native_stats`, a map as it reports them) do not have
  these keys yet reports none of them: the keys must then be there, `nil`.
  """
  def assert_paths(metadata, native_stats) do
    import ExUnit.Assertions

    for key <- [:decode_path, :prefill_path, :fallbacks] do
      assert Map.has_key?(metadata, key), "#{inspect(key)} missing from #{inspect(metadata)}"

      value = Map.fetch!(metadata, key)

      cond do
        not Map.has_key?(native_stats, key) -> assert value == nil
        key == :fallbacks -> assert is_list(value) and Enum.all?(value, &is_binary/1)
        true -> assert is_binary(value) and value != ""
      end
    end

    assert Map.has_key?(metadata, :kv_dtype), ":kv_dtype missing from #{inspect(metadata)}"

    if Map.has_key?(native_stats, :kv_dtype) do
      assert metadata.kv_dtype in EMLXAxon.Options.kv_dtypes()
      assert Atom.to_string(metadata.kv_dtype) == native_stats.kv_dtype
    else
      assert metadata.kv_dtype == nil
    end

    :ok
  end

  # Caches in :persistent_term; concurrent first calls may both load, which
  # is harmless.
  defp cached(key, fun) do
    key = {__MODULE__, key}

    case :persistent_term.get(key, :missing) do
      :missing ->
        value = fun.()
        :persistent_term.put(key, value)
        value

      value ->
        value
    end
  end
end
