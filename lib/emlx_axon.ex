defmodule EMLXAxon do
  @moduledoc """
  Qwen text generation for Elixir, running on Apple's MLX through a Rust NIF.

  The model's forward pass, sampling and KV cache run natively; Elixir
  drives generation chunk by chunk, so it can stream text, time out and be
  cancelled without blocking the VM.

    * `EMLXAxon.TextGeneration` - text in, text out: `run/4`, `stream/5`
      and an `Nx.Serving` (when your application has Nx)
    * `EMLXAxon.Qwen3.Loader` - loads Qwen3 and Qwen2 checkpoints, quantized
      (MLX format) or dense, optionally quantizing them as they load
    * `EMLXAxon.Qwen3.Generate` - token ids in, token ids out
    * `EMLXAxon.Tokenizer` - Hugging Face tokenizers and chat templates
    * `EMLXAxon.Stream` - MLX streams, to run generations concurrently
    * `EMLXAxon.Scheduler` - continuous batching: requests join a running
      batch as slots free up
    * `EMLXAxon.Result` - the keys of every result and its metadata
    * `EMLXAxon.Telemetry` - telemetry events (with the optional `:telemetry`)

  ## Quick start

      {:ok, tokenizer} = EMLXAxon.Tokenizer.load("~/models/Qwen3-0.6B-MLX-4bit")
      {:ok, state} = EMLXAxon.Qwen3.Loader.load("~/models/Qwen3-0.6B-MLX-4bit")

      EMLXAxon.TextGeneration.stream(tokenizer, state, [%{role: "user", content: "Hi!"}], &IO.write/1)

  Or from the command line: `mix emlx_axon.generate --help`.
  """

  @max_usize 0xFFFF_FFFF_FFFF_FFFF

  @doc """
  Returns information about the MLX runtime: its version, the default
  device, whether a GPU is available and the MLX backend the native part
  was built for (`:cpu`, `:cuda` or `:metal`; chosen with `config
  :emlx_axon, backend: ...` or `EMLX_AXON_BACKEND`, see the README).

  Everything else the native part reports is passed through as it gives
  it: a native part that reports them also has `:paths` (the engine paths
  this build and device offer, the names a result's `:decode_path` and
  `:prefill_path` take, see `EMLXAxon.Result`) and `:switches` (the
  environment switches it read, and their values).

  Raises a `RuntimeError` saying why and what to do when the native part
  could not be loaded, for example when it was built for another backend
  than the one asked for at run time.

  ## Examples

      iex> %{mlx_version: version, default_device: device, backend: backend} = EMLXAxon.mlx_info()
      iex> is_binary(version) and device in [:cpu, :gpu] and backend in [:cpu, :cuda, :metal]
      true

  """
  @spec mlx_info() :: %{
          required(:mlx_version) => String.t(),
          required(:default_device) => :cpu | :gpu,
          required(:gpu_available) => boolean(),
          required(:backend) => :cpu | :cuda | :metal | nil,
          optional(:paths) => term(),
          optional(:switches) => term(),
          optional(atom()) => term()
        }
  def mlx_info do
    if message = EMLXAxon.Native.load_error(), do: raise(message)

    backend =
      case EMLXAxon.Native.build_info() do
        %{backend: backend} -> backend
        nil -> nil
      end

    Map.put(EMLXAxon.Native.mlx_info(), :backend, backend)
  end

  @doc """
  Returns MLX's memory figures, in bytes, for the whole VM:

    * `:active` - held by live MLX arrays: loaded models' weights and
      running generations' KV caches
    * `:peak` - the highest `:active` since start or `reset_peak_memory/0`
    * `:cache` - freed buffers MLX keeps to reuse (see `clear_memory_cache/0`)
    * `:limit` - MLX's memory limit (on the CPU, 80% of the machine's
      memory): a checkpoint or a generation's KV cache that would take
      `:active` past it is refused with an `EMLXAxon.Error` of kind
      `:out_of_memory` rather than allocated

  A model's weights are freed when its `EMLXAxon.Qwen3.Model.State` is
  garbage collected; a generation's KV cache when the generation returns
  (or when the process running it dies).

  ## Examples

      iex> %{active: active, peak: peak, cache: cache, limit: limit} = EMLXAxon.memory_info()
      iex> Enum.all?([active, peak, cache, limit], &(is_integer(&1) and &1 >= 0))
      true

  """
  @spec memory_info() :: %{
          active: non_neg_integer(),
          peak: non_neg_integer(),
          cache: non_neg_integer(),
          limit: non_neg_integer()
        }
  def memory_info, do: ok!(EMLXAxon.Native.memory_info())

  @doc """
  Resets the `:peak` of `memory_info/0` (to zero on the CPU; MLX raises it
  again with the next allocation).
  """
  @spec reset_peak_memory() :: :ok
  def reset_peak_memory, do: ok!(EMLXAxon.Native.memory_reset_peak())

  @doc """
  Hands the freed buffers MLX keeps for reuse back to the system
  (`memory_info/0`'s `:cache` drops to zero).
  """
  @spec clear_memory_cache() :: :ok
  def clear_memory_cache, do: ok!(EMLXAxon.Native.memory_clear_cache())

  @doc """
  Sets MLX's memory limit (see `memory_info/0`) to `bytes` and returns the
  previous limit. It applies to the whole VM.

  ## Examples

      previous = EMLXAxon.set_memory_limit(8 * 1024 ** 3)

  """
  @spec set_memory_limit(pos_integer()) :: non_neg_integer()
  def set_memory_limit(bytes) when is_integer(bytes) and bytes > 0 and bytes <= @max_usize,
    do: ok!(EMLXAxon.Native.memory_set_limit(bytes))

  def set_memory_limit(other) do
    raise ArgumentError,
          "expected the memory limit to be a positive integer (bytes), got: #{inspect(other)}"
  end

  defp ok!({:ok, :ok}), do: :ok
  defp ok!({:ok, value}), do: value
  defp ok!({:error, reason}), do: raise(EMLXAxon.Error.from_native(reason))
end
