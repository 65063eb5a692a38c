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
        profile_timing: false
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

  @doc "A loaded model state, shared by all tests (loaded once)."
  def model(name, opts \\ []) do
    cached({:model, name, opts}, fn -> Loader.load!(path(name), opts) end)
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
