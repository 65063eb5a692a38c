defmodule EMLXAxon.Stream do
  @moduledoc """
  An MLX stream: an ordered queue of work on one device (CPU or GPU).

  Generations on different streams run concurrently; work on one stream
  runs in order. Every generation runs on some stream: the one given with
  the `:stream` option, else the process's default set by `with_stream/2`,
  else MLX's default stream for the default device.

  Streams only schedule work: a loaded model's weights are shared by all
  streams and are never copied, so opening a stream per worker process (or
  per `Nx.Serving` partition) costs no memory beyond each generation's own
  KV cache.

  ## Examples

      stream = EMLXAxon.Stream.new(:gpu)

      # Per call:
      {:ok, result} = EMLXAxon.Qwen3.Generate.generate(state, ids, stream: stream)

      # Or for everything the current process runs inside the function:
      EMLXAxon.Stream.with_stream(stream, fn ->
        EMLXAxon.TextGeneration.run(tokenizer, state, "Hello")
      end)

      :ok = EMLXAxon.Stream.close(stream)

  `new/1` raises when the stream cannot be opened (such as `:gpu` on a
  machine without one); `open/1` returns `{:ok, stream}` or
  `{:error, %EMLXAxon.Error{}}` instead.

  A stream is closed when `close/1` is called or when it is garbage
  collected. Using a closed stream returns (or raises) an
  `EMLXAxon.Error` of kind `:closed_stream`.
  """

  alias EMLXAxon.{Error, Native}

  @enforce_keys [:ref, :device]
  defstruct [:ref, :device]

  @typedoc "An MLX stream. `:device` is `:cpu` or `:gpu`."
  @type t :: %__MODULE__{ref: reference(), device: :cpu | :gpu}

  @type device :: :cpu | :gpu | :default

  @key {__MODULE__, :current}

  @doc """
  Opens a new stream on `device`: `:cpu`, `:gpu` or `:default` (MLX's
  default device: the GPU where there is one, else the CPU).

  Raises `EMLXAxon.Error` when the stream cannot be opened; see `open/1`
  for a variant returning a tuple.

  ## Examples

      stream = EMLXAxon.Stream.new()
      cpu = EMLXAxon.Stream.new(:cpu)

      EMLXAxon.Stream.with_stream(EMLXAxon.Stream.new(:gpu), fn ->
        Nx.Serving.run(serving, "Hello")
      end)

  """
  @spec new(device()) :: t()
  def new(device \\ :default) do
    case open(device) do
      {:ok, stream} -> stream
      {:error, error} -> raise error
    end
  end

  @doc """
  Same as `new/1`.
  """
  @spec new!(device()) :: t()
  def new!(device \\ :default), do: new(device)

  @doc """
  Like `new/1`, but returns `{:ok, stream}` or `{:error, %EMLXAxon.Error{}}`.

  ## Examples

      {:ok, stream} = EMLXAxon.Stream.open(:cpu)

  """
  @spec open(device()) :: {:ok, t()} | {:error, Error.t()}
  def open(device \\ :default)

  def open(device) when device in [:cpu, :gpu, :default] do
    with {:ok, ref} <- Error.wrap(Native.stream_new(device)),
         {:ok, %{device: actual}} <- Error.wrap(Native.stream_info(ref)) do
      {:ok, %__MODULE__{ref: ref, device: actual}}
    end
  end

  def open(device) do
    raise ArgumentError,
          "expected the stream device to be :cpu, :gpu or :default, got: #{inspect(device)}"
  end

  @doc """
  Closes the stream. Generations already running on it finish first;
  later use returns an `EMLXAxon.Error` of kind `:closed_stream`.
  Closing twice is fine.

  ## Examples

      :ok = EMLXAxon.Stream.close(stream)

  """
  @spec close(t()) :: :ok
  def close(%__MODULE__{ref: ref}) do
    :ok = Native.stream_close(ref)
  end

  @doc """
  Returns `%{device: :cpu | :gpu, index: integer, closed: boolean}`.

  ## Examples

      {:ok, %{device: :cpu, closed: false}} = EMLXAxon.Stream.info(stream)

  """
  @spec info(t()) ::
          {:ok, %{device: :cpu | :gpu, index: integer(), closed: boolean()}} | {:error, Error.t()}
  def info(%__MODULE__{ref: ref}), do: Error.wrap(Native.stream_info(ref))

  @doc """
  Runs `fun` with `stream` as the current process's default stream, then
  restores the previous default (also when `fun` raises).

  Generations started by this process without a `:stream` option run on
  it. The default is per process: processes spawned inside `fun` do not
  inherit it.

  ## Examples

      EMLXAxon.Stream.with_stream(stream, fn ->
        EMLXAxon.Qwen3.Generate.generate(state, [9707, 11])
      end)

  """
  @spec with_stream(t(), (() -> result)) :: result when result: term()
  def with_stream(%__MODULE__{} = stream, fun) when is_function(fun, 0) do
    previous = Process.put(@key, stream)

    try do
      fun.()
    after
      if previous, do: Process.put(@key, previous), else: Process.delete(@key)
    end
  end

  def with_stream(stream, fun) do
    raise ArgumentError,
          "expected an EMLXAxon.Stream and a zero-arity function, got: " <>
            "#{inspect(stream)} and #{inspect(fun)}"
  end

  @doc """
  Returns the current process's default stream set by `with_stream/2`,
  or `nil`.

  ## Examples

      nil = EMLXAxon.Stream.current()

  """
  @spec current() :: t() | nil
  def current, do: Process.get(@key)

  @doc false
  # The native stream reference for an explicit stream option, else the
  # process default, else nil (MLX's default stream).
  @spec resolve(t() | nil) :: reference() | nil
  def resolve(%__MODULE__{ref: ref}), do: ref

  def resolve(nil) do
    case current() do
      %__MODULE__{ref: ref} -> ref
      nil -> nil
    end
  end
end
