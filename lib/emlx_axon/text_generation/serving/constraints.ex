defmodule EMLXAxon.TextGeneration.Serving.Constraints do
  @moduledoc false
  # A serving's constraints (per input, or the serving's own) are checked
  # with the engine before they join a batch: a schema, regex or grammar
  # the engine refuses would otherwise fail a whole execution, and with it
  # every caller merged into it. The check raises ArgumentError in the
  # caller, as run/4 does.

  alias EMLXAxon.{Error, Native, Options, Tokenizer}
  alias EMLXAxon.Qwen3.Model.State

  # A generation of one prompt token and one new token: the engine compiles
  # a generation's constraints when it starts, before any model work, so
  # starting and freeing one compiles the constraint and nothing else.
  @probe %{
    max_new_tokens: 1,
    max_len: 2,
    sampler: :greedy,
    temperature: 1.0,
    top_p: 1.0,
    top_k: 0,
    min_p: 0.0,
    seed: nil,
    stop: [],
    eos_token_ids: nil,
    ignore_eos: false,
    profile_timing: false
  }

  @doc """
  Compiles each distinct constraint of `requests` (`nil` or `{kind, text}`
  under `:constraint`) for `tokenizer`; raises `ArgumentError` with the
  engine's reason for the first one it refuses.
  """
  @spec check!(Tokenizer.t(), State.t(), [map()]) :: :ok
  def check!(tokenizer, state, requests) do
    requests
    |> Enum.map(&Map.get(&1, :constraint))
    |> Enum.reject(&is_nil/1)
    |> Enum.uniq()
    |> Enum.each(&compile!(tokenizer, state, &1))
  end

  defp compile!(tokenizer, state, constraint) do
    opts = Options.native(Map.put(@probe, :row_constraints, [constraint]))

    case Error.wrap(Native.generation_start(state.ref, tokenizer.ref, nil, [[0]], opts)) do
      {:ok, generation} ->
        Native.generation_free(generation)
        :ok

      {:error, %Error{kind: :invalid_constraint, message: message}} ->
        raise ArgumentError, message

      {:error, error} ->
        raise error
    end
  end
end
