defmodule EMLXAxon.Native do
  @moduledoc false
  # Low-level bindings to the `emlx_axon_nif` Rust crate. The library is
  # built by `Mix.Tasks.Compile.EmlxAxonNative` (native/mix_compiler.ex) and
  # installed as priv/native/libemlx_axon_nif.so.
  #
  # Unless noted, functions return `{:ok, term}` or `{:error, {kind, message}}`
  # (see `EMLXAxon.Error` for the kinds); bad argument types raise
  # ArgumentError, except a field of the wrong type inside an options map,
  # which raises an ErlangError naming the field. The public
  # modules validate arguments before calling in.

  require Logger
  # on_load runs as soon as this module is compiled: make sure the module it
  # calls is compiled first.
  require EMLXAxon.NativeBuild

  @on_load :load_nif
  @nif_path "native/libemlx_axon_nif"
  @error_key {__MODULE__, :load_error}
  @build_key {__MODULE__, :build}

  @doc false
  def load_nif do
    with {:ok, path} <- nif_path(),
         {:ok, info} <- check_build(path) do
      case :erlang.load_nif(String.to_charlist(path), 0) do
        :ok ->
          :persistent_term.erase(@error_key)
          :ok

        {:error, {reason, text}} ->
          report_load_error(path, "#{reason}: #{text}" <> EMLXAxon.NativeBuild.load_hint(info))

        {:error, other} ->
          report_load_error(path, inspect(other))
      end
    else
      {:error, path, why} -> report_load_error(path, why, "")
      {:error, reason} -> report_load_error(@nif_path, reason)
    end
  end

  # The backend and target recorded beside the library must suit this
  # machine and what is asked for; a library without that record (built by
  # an older compiler) is loaded as it is.
  defp check_build(path) do
    case EMLXAxon.NativeBuild.read(Path.dirname(path)) do
      {:ok, info} ->
        :persistent_term.put(@build_key, info)

        case EMLXAxon.NativeBuild.check(info) do
          :ok -> {:ok, info}
          {:error, why} -> {:error, path, why}
        end

      :error ->
        :persistent_term.erase(@build_key)
        {:ok, nil}
    end
  end

  @fix """

  To fix it, build the NIF with `mix compile` (it runs cargo; run scripts/setup \
  first on a fresh machine to install MLX) or install a precompiled one \
  (EMLX_AXON_PRECOMPILED), or unset EMLX_AXON_SKIP_NATIVE if it is set. \
  If the library exists but cannot be loaded, check that the MLX shared library it \
  links against is installed (MLX_PREFIX / scripts/setup).\
  """

  # The module stays loaded even when the library does not: every function
  # then raises :nif_not_loaded, and `load_error/0` says why.
  defp report_load_error(path, why, fix \\ @fix) do
    message = "could not load the emlx_axon NIF from #{path}.so: #{why}\n" <> fix

    :persistent_term.put(@error_key, message)
    Logger.warning(message)
    :ok
  end

  defp nif_path do
    case :code.priv_dir(:emlx_axon) do
      {:error, reason} ->
        {:error, "the :emlx_axon application's priv directory was not found (#{reason})"}

      priv ->
        {:ok, Path.join(List.to_string(priv), @nif_path)}
    end
  end

  @doc false
  # What the Mix compiler recorded about the library (its backend...), or nil.
  @spec build_info() :: map() | nil
  def build_info, do: :persistent_term.get(@build_key, nil)

  @doc false
  # nil when the NIF is loaded, otherwise a message saying why it is not.
  @spec load_error() :: nil | String.t()
  def load_error, do: :persistent_term.get(@error_key, nil)

  ## Runtime

  def mlx_info, do: err()
  def memory_info, do: err()
  def memory_reset_peak, do: err()
  def memory_clear_cache, do: err()
  def memory_set_limit(_bytes), do: err()

  ## Models

  def model_load(_path, _opts), do: err()
  def model_info(_model), do: err()
  def quantization_support, do: err()

  ## Tokenizers

  def tokenizer_load(_path), do: err()
  def tokenizer_encode(_tokenizer, _text, _add_special_tokens), do: err()
  def tokenizer_decode(_tokenizer, _ids, _skip_special_tokens), do: err()

  def tokenizer_apply_chat_template(
        _tokenizer,
        _messages_json,
        _tools_json,
        _add_generation_prompt,
        _thinking
      ),
      do: err()

  def tokenizer_info(_tokenizer), do: err()

  ## Streams

  def stream_new(_device), do: err()
  def stream_close(_stream), do: err()
  def stream_info(_stream), do: err()

  ## Generation

  def generation_start(_model, _tokenizer, _stream, _prompts, _opts), do: err()
  def generation_next(_generation, _max_steps), do: err()
  def generation_stats(_generation), do: err()
  def generation_cancel_rows(_generation, _rows), do: err()
  def generation_free(_generation), do: err()

  ## Constraints

  def constraint_check(_tokenizer, _constraint), do: err()

  ## Scheduler (continuous batching)

  def scheduler_new(_model, _tokenizer, _opts), do: err()
  def scheduler_admit(_scheduler, _prompt, _opts), do: err()
  def scheduler_cancel(_scheduler, _ids), do: err()
  def scheduler_occupancy(_scheduler), do: err()
  def scheduler_clear_prefix_cache(_scheduler), do: err()
  def scheduler_free(_scheduler), do: err()

  defp err do
    case load_error() do
      nil -> :erlang.nif_error(:nif_not_loaded)
      why -> :erlang.nif_error({:nif_not_loaded, why})
    end
  end
end
