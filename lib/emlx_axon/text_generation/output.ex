defmodule EMLXAxon.TextGeneration.Output do
  @moduledoc false
  # Builds the outputs of EMLXAxon.TextGeneration: one map per input, in
  # Bumblebee's shape around an EMLXAxon.Result (which has both EMLXAxon's
  # keys and Bumblebee's), so code written against either library reads
  # them unchanged.

  alias EMLXAxon.Tokenizer

  @type finish_reason :: :eos | :stop | :length | :max_len | :timeout | :cancelled

  @typedoc """
  A finished row: its ids and text, why it ended, its prompt's length and
  the left padding it was given to share a batch.
  """
  @type row :: %{
          required(:ids) => [non_neg_integer()],
          required(:text) => String.t(),
          required(:finish_reason) => finish_reason(),
          required(:prompt_tokens) => non_neg_integer(),
          required(:padding) => non_neg_integer()
        }

  @doc """
  The output for one finished row with its `metadata`: Bumblebee's shape
  around an `EMLXAxon.Result`.
  """
  @spec build(row(), map()) :: map()
  def build(row, metadata) do
    result =
      EMLXAxon.Result.new(row.ids, row.text, row.finish_reason, row.prompt_tokens, row.padding)

    %{results: [result], metadata: metadata}
  end

  @doc """
  `output` with its result's tool calls when `tools` were offered (not
  `nil`): `tool_calls` (the answer's well-formed `<tool_call>` blocks,
  parsed) and `tool_call_errors` (the malformed ones). Every path that
  builds outputs (a direct run, a scheduler's, a serving's) ends here.
  """
  @spec put_tool_calls(map(), nil | [map()]) :: map()
  def put_tool_calls(output, nil), do: output

  def put_tool_calls(%{results: [result]} = output, _tools) do
    {:ok, calls, errors} = EMLXAxon.ToolCalls.parse(result.generated_text)
    %{output | results: [Map.merge(result, %{tool_calls: calls, tool_call_errors: errors})]}
  end

  @doc "See `EMLXAxon.Result.paddings/1`."
  defdelegate paddings(prompt_lengths), to: EMLXAxon.Result

  @doc """
  Decodes generated `ids` into the row's text the way the engine does while
  streaming: an EOS token is not decoded, ids past the tokenizer's
  vocabulary have no text, and a `:stop` row's text ends before the first
  stop string.
  """
  @spec text!(Tokenizer.t(), [non_neg_integer()], finish_reason(), [String.t()]) :: String.t()
  def text!(tokenizer, ids, finish_reason, stop) do
    ids = if finish_reason == :eos, do: Enum.drop(ids, -1), else: ids
    ids = Enum.filter(ids, &(&1 < tokenizer.vocab_size))

    text =
      case Tokenizer.decode(tokenizer, ids, skip_special_tokens: true) do
        {:ok, text} -> text
        {:error, error} -> raise error
      end

    if finish_reason == :stop, do: cut_at_stop(text, stop), else: text
  end

  @doc "`text` up to the first occurrence of any of the `stop` strings."
  @spec cut_at_stop(String.t(), [String.t()]) :: String.t()
  def cut_at_stop(text, stop) do
    stop
    |> Enum.flat_map(fn s ->
      case :binary.match(text, s) do
        {at, _} -> [at]
        :nomatch -> []
      end
    end)
    |> case do
      [] -> text
      positions -> binary_part(text, 0, Enum.min(positions))
    end
  end
end
