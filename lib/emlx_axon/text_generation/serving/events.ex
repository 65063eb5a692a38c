defmodule EMLXAxon.TextGeneration.Serving.Events do
  @moduledoc false
  # A streaming serving's events, without Nx. During an execution each
  # native chunk's new text goes to the callers as a u8 matrix (one row of
  # text per batch row, zero-padded) with each row's byte size; the caller
  # turns its row back into a binary. The stream then ends, when
  # :stream_done is set, with `{:done, output}`: Bumblebee's shape (a
  # `:token_summary`) with EMLXAxon's output (`:results`, `:metadata`).

  @doc """
  A chunk's rows of new text as `{matrix_binary, {rows, width}, sizes}`,
  where `sizes` holds each row's byte size as native-endian s32.
  """
  @spec encode_chunk([%{text: binary()}]) :: {binary(), {pos_integer(), pos_integer()}, binary()}
  def encode_chunk(rows) do
    texts = Enum.map(rows, & &1.text)
    width = texts |> Enum.map(&byte_size/1) |> Enum.max(fn -> 0 end) |> max(1)

    matrix =
      IO.iodata_to_binary(
        Enum.map(texts, fn text -> [text, :binary.copy(<<0>>, width - byte_size(text))] end)
      )

    sizes = for text <- texts, into: <<>>, do: <<byte_size(text)::signed-native-32>>
    {matrix, {length(rows), width}, sizes}
  end

  @doc """
  The items a caller's stream yields for one event: `{:chunk, row_binary,
  size}` (its row of the chunk matrix and its byte size) gives the text,
  if any; `{:done, output}` gives the final event when `stream_done?`.
  """
  @spec items({:chunk, binary(), non_neg_integer()} | {:done, map()}, boolean()) :: [term()]
  def items({:chunk, row, size}, _stream_done?) do
    case binary_part(row, 0, size) do
      "" -> []
      text -> [text]
    end
  end

  def items({:done, _output}, false), do: []
  def items({:done, output}, true), do: [done(output)]

  @doc "The final event for `output` (one input's output)."
  @spec done(map()) :: {:done, map()}
  def done(%{results: [%{token_summary: summary}]} = output) do
    {:done, Map.put(output, :token_summary, summary)}
  end
end
