defmodule EMLXAxon.Error do
  @moduledoc """
  An error reported by the native engine (or by the Elixir layer on its
  behalf), such as a missing checkpoint file or a prompt that does not fit
  in `:max_len`.

  Functions returning `{:error, reason}` give an `EMLXAxon.Error` as the
  reason; the bang variants and `EMLXAxon.TextGeneration` raise it.

  `:kind` is a stable atom to match on:

    * `:io` - a file or directory could not be read
    * `:json` - a JSON file is malformed
    * `:config` - `config.json` is missing a field or has a bad value
    * `:safetensors` - a weights file is malformed
    * `:missing_tensor` / `:shape_mismatch` - the weights do not match the config
    * `:unexpected_tensor` - the checkpoint holds tensors the model does not
      use (see `EMLXAxon.Qwen3.Loader.load/2`'s `:strict`)
    * `:unsupported` - the checkpoint uses something the engine does not support
    * `:mlx` - MLX itself failed
    * `:tokenizer` / `:template` - tokenization or chat-template rendering failed
    * `:invalid_argument` - an argument was rejected by the engine
    * `:prompt_too_long` - the prompt leaves no room in `:max_len`
    * `:out_of_memory` - the checkpoint or the generation's KV cache cannot
      fit in MLX's memory limit (see `EMLXAxon.memory_info/0`)
    * `:closed_stream` - an `EMLXAxon.Stream` was used after `EMLXAxon.Stream.close/1`
    * `:released` - a generation was used after it was freed
    * `:overloaded` - a scheduler's queue is full: the request was refused at once
    * `:scheduler_down` - the scheduler a request was sent to exited (or was not
      running) before the request ended
    * `:panic` - the native code panicked (a bug: please report it)
    * `:not_found`, `:unauthorized`, `:checksum`, `:network`, `:offline` -
      a download from the Hugging Face Hub failed (see `EMLXAxon.Hub`)

  ## Examples

      iex> error = EMLXAxon.Error.exception(kind: :io, message: "no such directory")
      iex> Exception.message(error)
      "(io) no such directory"

  """

  defexception [:kind, :message]

  @type kind ::
          :io
          | :json
          | :config
          | :safetensors
          | :missing_tensor
          | :shape_mismatch
          | :unexpected_tensor
          | :unsupported
          | :mlx
          | :tokenizer
          | :template
          | :invalid_argument
          | :prompt_too_long
          | :out_of_memory
          | :closed_stream
          | :released
          | :overloaded
          | :scheduler_down
          | :panic
          | :not_found
          | :unauthorized
          | :checksum
          | :network
          | :offline

  @type t :: %__MODULE__{kind: kind() | atom(), message: String.t()}

  @impl true
  def exception(opts) when is_list(opts) do
    %__MODULE__{kind: Keyword.fetch!(opts, :kind), message: Keyword.fetch!(opts, :message)}
  end

  @impl true
  def message(%__MODULE__{kind: kind, message: message}), do: "(#{kind}) #{message}"

  @doc false
  # Turns the NIF's `{kind, message}` error into an exception struct.
  @spec from_native(term()) :: t()
  def from_native({kind, message}) when is_atom(kind) and is_binary(message),
    do: %__MODULE__{kind: kind, message: message}

  def from_native(%__MODULE__{} = error), do: error

  def from_native(other),
    do: %__MODULE__{
      kind: :invalid_argument,
      message: "unexpected native error: #{inspect(other)}"
    }

  @doc false
  # Normalizes a native `{:ok, value} | {:error, {kind, msg}}` result.
  @spec wrap({:ok, term()} | {:error, term()} | :ok) :: {:ok, term()} | {:error, t()} | :ok
  def wrap({:ok, _} = ok), do: ok
  def wrap(:ok), do: :ok
  def wrap({:error, reason}), do: {:error, from_native(reason)}
end
