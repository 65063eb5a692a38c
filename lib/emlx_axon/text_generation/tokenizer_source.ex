defmodule EMLXAxon.TextGeneration.TokenizerSource do
  @moduledoc false
  # The tokenizers EMLXAxon.TextGeneration accepts: an EMLXAxon.Tokenizer,
  # or the tokenizers Bumblebee users already hold -- a Bumblebee tokenizer
  # struct (`Bumblebee.load_tokenizer/1`, whose :native_tokenizer is a
  # `Tokenizers.Tokenizer`) or a bare `Tokenizers.Tokenizer`. Neither
  # package is a dependency: their structs are recognized by name, and the
  # `tokenizers` package is only called when such a struct is given (its
  # holder has it loaded).

  alias EMLXAxon.Tokenizer

  @doc """
  Returns an `EMLXAxon.Tokenizer` for `tokenizer`.

  With `dir` (a checkpoint directory), `nil` and foreign tokenizers are
  loaded from the directory's own files, chat template included. Without
  it, a foreign tokenizer is copied through `Tokenizers.Tokenizer.save/3`;
  such a copy has no chat template (Bumblebee keeps it elsewhere), so chat
  inputs then fail with an `EMLXAxon.Error` of kind `:template`.
  """
  @spec resolve!(term(), Path.t() | nil) :: Tokenizer.t()
  def resolve!(tokenizer, dir \\ nil)

  def resolve!(%Tokenizer{} = tokenizer, _dir), do: tokenizer
  def resolve!({:hf, _} = repository, _dir), do: Tokenizer.load!(repository)
  def resolve!({:hf, _, _} = repository, _dir), do: Tokenizer.load!(repository)
  def resolve!(nil, dir) when is_binary(dir), do: Tokenizer.load!(dir)

  def resolve!(tokenizer, dir) do
    case native(tokenizer) do
      {:ok, _native} when is_binary(dir) -> Tokenizer.load!(dir)
      {:ok, native} -> from_native!(native)
      :error -> raise ArgumentError, error(tokenizer)
    end
  end

  defp native(%{__struct__: Tokenizers.Tokenizer} = native), do: {:ok, native}

  defp native(%{
         __struct__: module,
         native_tokenizer: %{__struct__: Tokenizers.Tokenizer} = native
       }) do
    if bumblebee?(module), do: {:ok, native}, else: :error
  end

  defp native(_other), do: :error

  defp bumblebee?(module), do: String.starts_with?(Atom.to_string(module), "Elixir.Bumblebee.")

  defp from_native!(native) do
    dir =
      Path.join(System.tmp_dir!(), "emlx_axon_tokenizer_#{System.unique_integer([:positive])}")

    file = Path.join(dir, "tokenizer.json")
    File.mkdir_p!(dir)

    try do
      # `tokenizers` is optional: called dynamically so this compiles without it.
      case apply(Tokenizers.Tokenizer, :save, [native, file]) do
        {:error, reason} ->
          raise EMLXAxon.Error,
            kind: :tokenizer,
            message: "could not save the Tokenizers.Tokenizer to read it: #{inspect(reason)}"

        _ ->
          Tokenizer.load!(file)
      end
    after
      File.rm_rf(dir)
    end
  end

  defp error(other) do
    "expected an EMLXAxon.Tokenizer (from EMLXAxon.Tokenizer.load/1), a Bumblebee tokenizer " <>
      "(from Bumblebee.load_tokenizer/1), a Tokenizers.Tokenizer or {:hf, repo}, " <>
      "got: #{inspect(other)}"
  end
end
