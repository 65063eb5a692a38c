defmodule EMLXAxon.TextGeneration.Serving.Constraints do
  @moduledoc false
  # A serving's constraints (per input, or the serving's own) are checked
  # with the engine before they join a batch: a schema, regex or grammar
  # the engine refuses would otherwise fail a whole execution, and with it
  # every caller merged into it. The check raises ArgumentError in the
  # caller, as run/4 does.

  alias EMLXAxon.{Error, Native, Tokenizer}

  @doc """
  Compiles each distinct constraint of `requests` (`nil` or `{kind, text}`
  under `:constraint`) for `tokenizer`; raises `ArgumentError` with the
  engine's reason for the first one it refuses.
  """
  @spec check!(Tokenizer.t(), [map()]) :: :ok
  def check!(tokenizer, requests) do
    requests
    |> Enum.map(&Map.get(&1, :constraint))
    |> Enum.reject(&is_nil/1)
    |> Enum.uniq()
    |> Enum.each(&compile!(tokenizer, &1))
  end

  defp compile!(tokenizer, constraint) do
    case Error.wrap(Native.constraint_check(tokenizer.ref, constraint)) do
      {:ok, true} ->
        :ok

      {:error, %Error{kind: :invalid_constraint, message: message}} ->
        raise ArgumentError, message

      {:error, error} ->
        raise error
    end
  end
end
