defmodule EMLXAxon.TextGeneration.Input do
  @moduledoc false
  # Turns what callers pass to EMLXAxon.TextGeneration (strings, input maps,
  # chat messages, token ids, or lists of them) into requests: the prompt's
  # token ids and the input's own options.

  alias EMLXAxon.{Generation, Options, Tokenizer}
  alias EMLXAxon.Qwen3.Model.State

  @typedoc "One prompt to generate from, with the options its input map gave."
  @type request :: %{
          required(:ids) => [non_neg_integer()],
          required(:seed) => nil | non_neg_integer(),
          optional(:constraint) => nil | {atom(), String.t()}
        }

  # Keys an input map may have besides the one holding the prompt.
  @input_options [:seed | Options.constraint_keys()]
  @prompt_keys [:text, :messages, :input_ids]

  @doc """
  Normalizes and encodes `input`: `{requests, multi?}`, where `multi?` says
  the caller gave a list of inputs (and expects a list of outputs). With a
  `state`, the prompts are checked against the model's vocabulary.
  """
  @spec requests!(Tokenizer.t(), State.t() | nil, term(), map()) :: {[request()], boolean()}
  def requests!(tokenizer, state, input, opts) do
    {items, multi?} = normalize!(input)

    requests =
      Enum.map(items, fn {prompt, input_opts} ->
        Map.put(input_opts, :ids, encode!(tokenizer, prompt, opts))
      end)

    if state, do: Generation.validate_prompts!(Enum.map(requests, & &1.ids), state)
    {requests, multi?}
  end

  @doc """
  Normalizes `input` without encoding it: `{[{prompt, input_opts}], multi?}`
  where `prompt` is `{:text, string}`, `{:chat, messages}` or `{:ids, ids}`.
  """
  @spec normalize!(term()) :: {[{tuple(), map()}], boolean()}
  def normalize!([]) do
    raise ArgumentError, "expected an input to generate from, got an empty list"
  end

  def normalize!(input) when is_list(input) do
    if Enum.all?(input, &Tokenizer.message?/1) do
      {[{{:chat, input}, %{seed: nil, constraint: nil}}], false}
    else
      {Enum.map(input, &item!/1), true}
    end
  end

  def normalize!(input), do: {[item!(input)], false}

  @doc """
  The row seeds for the native generation: `nil` when no request has its
  own seed (the `:seed` option then seeds the whole batch), else one per
  request, a request without its own seed taking `default`.
  """
  @spec row_seeds([request()], nil | non_neg_integer()) :: nil | [nil | non_neg_integer()]
  def row_seeds(requests, default) do
    if Enum.any?(requests, & &1.seed) do
      Enum.map(requests, &(&1.seed || default))
    end
  end

  @doc """
  The row constraints for the native generation: `nil` when no request is
  constrained, else one `nil` or `{kind, text}` per request, a request
  without its own constraint taking `default` (the options' constraint).
  """
  @spec row_constraints([request()], nil | {atom(), String.t()}) :: nil | [nil | tuple()]
  def row_constraints(requests, default) do
    rows = Enum.map(requests, &(Map.get(&1, :constraint) || default))
    if Enum.any?(rows), do: rows
  end

  defp item!(text) when is_binary(text), do: {{:text, text}, %{seed: nil, constraint: nil}}

  defp item!(%{} = input) when not is_struct(input) do
    case Enum.filter(@prompt_keys, &Map.has_key?(input, &1)) do
      [key] ->
        unknown = Map.keys(input) -- [key | @input_options]

        if unknown != [] do
          raise ArgumentError,
                "unknown key(s) #{Enum.map_join(unknown, ", ", &inspect/1)} in input " <>
                  "#{inspect(input)}: an input map has one of :text, :messages or " <>
                  ":input_ids, and optionally :seed and one of :json_schema, :regex or :grammar"
        end

        {prompt!(key, Map.fetch!(input, key), input),
         %{seed: seed!(Map.get(input, :seed)), constraint: Options.constraint!(input, "an input")}}

      _ ->
        raise ArgumentError, input_error(input)
    end
  end

  defp item!([_ | _] = messages) do
    if Enum.all?(messages, &Tokenizer.message?/1) do
      {{:chat, messages}, %{seed: nil, constraint: nil}}
    else
      raise ArgumentError, input_error(messages)
    end
  end

  defp item!(other), do: raise(ArgumentError, input_error(other))

  defp prompt!(:text, text, _input) when is_binary(text), do: {:text, text}
  defp prompt!(:messages, messages, _input) when is_list(messages), do: {:chat, messages}
  defp prompt!(:input_ids, ids, _input) when is_list(ids), do: {:ids, ids}
  defp prompt!(_key, _value, input), do: raise(ArgumentError, input_error(input))

  defp seed!(nil), do: nil
  defp seed!(seed) when is_integer(seed) and seed >= 0, do: seed

  defp seed!(seed) do
    raise ArgumentError,
          "expected an input's :seed to be nil or a non-negative integer, got: #{inspect(seed)}"
  end

  defp input_error(input) do
    "expected each input to be a string, %{text: string}, %{messages: messages}, " <>
      "%{input_ids: ids} (optionally with :seed) or a list of chat messages, " <>
      "got: #{inspect(input)}"
  end

  defp encode!(tokenizer, {:text, text}, %{chat: true} = opts),
    do: encode!(tokenizer, {:chat, [{"user", text}]}, opts)

  defp encode!(tokenizer, {:text, text}, _opts) do
    if text == "", do: raise(ArgumentError, "cannot generate from an empty string")
    ok!(Tokenizer.encode(tokenizer, text, add_special_tokens: true))
  end

  defp encode!(tokenizer, {:chat, messages}, opts) do
    prompt =
      ok!(
        Tokenizer.apply_chat_template(tokenizer, messages,
          add_generation_prompt: true,
          enable_thinking: opts.enable_thinking,
          tools: Map.get(opts, :tools)
        )
      )

    ok!(Tokenizer.encode(tokenizer, prompt, add_special_tokens: false))
  end

  defp encode!(_tokenizer, {:ids, ids}, _opts), do: ids

  defp ok!({:ok, value}), do: value
  defp ok!({:error, error}), do: raise(error)
end
