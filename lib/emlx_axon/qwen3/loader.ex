defmodule EMLXAxon.Qwen3.Loader do
  @moduledoc """
  Loads Qwen3 and Qwen2 checkpoints in the Hugging Face / MLX layout: a
  directory with `config.json` and one or more `*.safetensors` files
  (sharded checkpoints with `model.safetensors.index.json` included).

  Both MLX-quantized checkpoints (such as `mlx-community/Qwen3-0.6B-4bit`,
  any bit width and group size, including per-layer mixed quantization) and
  dense `bfloat16` / `float16` / `float32` checkpoints load; a dense
  checkpoint can also be quantized while loading with the `:quantize`
  option.

  ## Files and memory

  Loading copies every tensor out of the checkpoint's files into MLX's own
  memory; the files are memory-mapped only while `load/2` runs. A loaded
  model therefore does not depend on its files: they can be overwritten,
  truncated, replaced or deleted afterwards and the model generates exactly
  as before (only a later load sees the change). Do not modify the files
  *while* they load: a file truncated under a running load can fault the
  mapping, as with any memory-mapped loader.

  The weights stay in memory until the returned state is garbage collected
  (no process references it any more). A checkpoint that would take MLX
  past its memory limit, counting the conversion to the compute dtype, is
  refused with an error of kind `:out_of_memory` before anything is copied
  (see `EMLXAxon.memory_info/0`).

  ## Examples

      {:ok, state} = EMLXAxon.Qwen3.Loader.load("~/models/Qwen3-0.6B-MLX-4bit")
      state.config.num_layers
      #=> 28

      # A dense checkpoint, quantized to 4 bits as it loads:
      state = EMLXAxon.Qwen3.Loader.load!("~/models/Qwen3-0.6B", quantize: [bits: 4, group_size: 64])

  """

  alias EMLXAxon.{Error, Native, Options, Telemetry}
  alias EMLXAxon.Qwen3.Model.State

  @dtypes [:float32, :bfloat16, :float16]

  @schema [
    dtype: [
      type: {:in, [nil | @dtypes]},
      default: nil,
      default_doc: "`:float32` on the CPU, `:bfloat16` on the GPU",
      doc:
        "the compute dtype; quantized weights stay quantized, their scales and the " <>
          "other weights use it"
    ],
    quantize: [
      type:
        {:custom, {__MODULE__, :quantize_option},
         "nil or a keyword list like [bits: 4, group_size: 64]"},
      default: nil,
      doc:
        "quantize a dense checkpoint while loading, with `:bits` 2, 3, 4, 5, 6 or 8 and " <>
          "`:group_size` 32, 64 (the default) or 128, as the engine reports them; `nil` " <>
          "loads as stored"
    ],
    strict: [
      type: :boolean,
      default: true,
      doc:
        "refuse a checkpoint holding tensors the model does not use (an `EMLXAxon.Error` " <>
          "of kind `:unexpected_tensor` naming them), as mlx-lm's loader does; `false` " <>
          "ignores them"
    ]
  ]

  @doc false
  def schema, do: @schema

  @doc """
  Loads the checkpoint in directory `path` (`~` is expanded; `{:local, path}`
  is accepted too), or from the Hugging Face Hub as `{:hf, repo}` or
  `{:hf, repo, options}` (downloaded into a cache first: see `EMLXAxon.Hub`).

  ## Options

  #{EMLXAxon.Options.docs(@schema)}

  Returns `{:error, %EMLXAxon.Error{}}` when the directory or its files are
  missing or do not match the configuration.

  Emits the `[:emlx_axon, :load]` telemetry span (see `EMLXAxon.Telemetry`).

  ## Examples

      {:ok, state} = EMLXAxon.Qwen3.Loader.load("~/models/Qwen3-0.6B-MLX-4bit", dtype: :float16)
      {:ok, state} = EMLXAxon.Qwen3.Loader.load({:hf, "mlx-community/Qwen3-0.6B-4bit"})
      {:error, %EMLXAxon.Error{kind: :io}} = EMLXAxon.Qwen3.Loader.load("/no/such/dir")

  """
  @spec load(Path.t() | {:local, Path.t()} | EMLXAxon.Hub.repository(), keyword()) ::
          {:ok, State.t()} | {:error, Error.t()}
  def load(path, opts \\ [])

  def load({:local, path}, opts), do: load(path, opts)

  def load({:hf, _} = repository, opts), do: load_hub(repository, opts)
  def load({:hf, _, _} = repository, opts), do: load_hub(repository, opts)

  def load(path, opts) when is_binary(path) do
    native_opts = validate_opts!(opts)
    path = Path.expand(path)

    Telemetry.span([:emlx_axon, :load], %{path: path}, fn ->
      result = do_load(path, native_opts)

      case result do
        {:ok, %State{config: config}} ->
          measurements = %{
            load_ms: config[:load_ms] || 0.0,
            weight_bytes: config[:weight_bytes] || 0
          }

          metadata = Map.take(config, [:model_type, :quantization, :dtype])
          {result, measurements, metadata}

        {:error, error} ->
          {result, %{}, %{error: error}}
      end
    end)
  end

  def load(path, _opts) do
    raise ArgumentError,
          "expected a checkpoint directory path (string), {:local, path} or {:hf, repo}, " <>
            "got: #{inspect(path)}"
  end

  # Options are checked before anything is downloaded.
  defp load_hub(repository, opts) do
    validate_opts!(opts)

    with {:ok, dir} <- EMLXAxon.Hub.fetch(repository, :checkpoint), do: load(dir, opts)
  end

  @doc """
  Like `load/2`, but raises `EMLXAxon.Error` on failure.

  ## Examples

      state = EMLXAxon.Qwen3.Loader.load!("~/models/Qwen3-0.6B-MLX-4bit")

  """
  @spec load!(Path.t() | {:local, Path.t()} | EMLXAxon.Hub.repository(), keyword()) ::
          State.t()
  def load!(path, opts \\ []) do
    case load(path, opts) do
      {:ok, state} -> state
      {:error, error} -> raise error
    end
  end

  defp do_load(path, native_opts) do
    cond do
      not File.dir?(path) ->
        {:error, %Error{kind: :io, message: "checkpoint directory does not exist: #{path}"}}

      not File.regular?(Path.join(path, "config.json")) ->
        {:error, %Error{kind: :io, message: "no config.json in checkpoint directory #{path}"}}

      true ->
        with {:ok, ref} <- Error.wrap(Native.model_load(path, native_opts)),
             {:ok, config} <- Error.wrap(Native.model_info(ref)) do
          {:ok, %State{ref: ref, config: config, path: path}}
        end
    end
  end

  defp validate_opts!(opts) do
    opts = Options.validate!(opts, @schema, "EMLXAxon.Qwen3.Loader.load/2")
    {bits, group_size} = opts.quantize || {nil, nil}

    %{
      dtype: opts.dtype && Atom.to_string(opts.dtype),
      quantize_bits: bits,
      quantize_group_size: group_size,
      strict: opts.strict
    }
  end

  @doc false
  # `:quantize` as `{bits, group_size}`, checked against the engine's own
  # list so the two cannot drift apart.
  def quantize_option(quantize) when quantize in [nil, false], do: {:ok, nil}

  def quantize_option(quantize) when is_list(quantize) do
    if Keyword.keyword?(quantize) and Keyword.keys(quantize) -- [:bits, :group_size] == [] do
      bits = Keyword.get(quantize, :bits, 4)
      group_size = Keyword.get(quantize, :group_size, 64)
      supported = Native.quantization_support()

      cond do
        not (is_integer(bits) and bits in supported.bits) ->
          {:error, "expected :bits to be one of #{inspect(supported.bits)}"}

        not (is_integer(group_size) and group_size in supported.group_sizes) ->
          {:error, "expected :group_size to be one of #{inspect(supported.group_sizes)}"}

        true ->
          {:ok, {bits, group_size}}
      end
    else
      :error
    end
  end

  def quantize_option(_other), do: :error
end
