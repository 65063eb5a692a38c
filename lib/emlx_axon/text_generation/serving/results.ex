defmodule EMLXAxon.TextGeneration.Serving.Results do
  @moduledoc false
  # How an execution's results travel back to the serving's callers,
  # without Nx: the adapter only wraps these binaries in tensors.
  #
  # Every field has one entry per row (token ids padded to :max_new_tokens
  # with -1), so Nx.Serving can slice the rows of each caller and
  # concatenate them when a caller's input was split over several
  # executions. That includes the execution's metadata (batch size and
  # timings): each row carries its own execution's, so split inputs report
  # the execution that actually ran them.

  alias EMLXAxon.{Generation, Result}
  alias EMLXAxon.TextGeneration.Output

  @pad -1
  @finish_codes %{eos: 0, stop: 1, length: 2, max_len: 3, timeout: 4, cancelled: 5}
  @finish_reasons Map.new(@finish_codes, fn {reason, code} -> {code, reason} end)

  @int_fields [:num_tokens, :prompt_tokens, :padding, :batch_size, :forced_tokens]
  @float_fields [
    :prefill_ms,
    :decode_ms,
    :decode_tokens_per_s,
    :time_to_first_token_ms,
    :total_ms
  ]

  # The engine paths (`EMLXAxon.Result.paths/1`) travel as one row of bytes
  # per request, of one width whatever the execution, so rows of several
  # executions concatenate: their external term format, zero-padded.
  @paths_width 1024

  @typedoc "A field: its Nx type, its shape and its native-endian data."
  @type field :: {{atom(), pos_integer()}, tuple(), binary()}

  @doc """
  The fields of a finished generation (`rows` and `stats` from
  `EMLXAxon.Generation.run/6`).
  """
  @spec encode([Generation.row()], Generation.stats(), pos_integer()) :: %{atom() => field()}
  def encode(rows, stats, max_new_tokens) do
    n = length(rows)

    token_ids =
      for %{ids: ids} <- rows, into: <<>> do
        padded = ids ++ List.duplicate(@pad, max_new_tokens - length(ids))
        for id <- padded, into: <<>>, do: <<id::signed-native-32>>
      end

    ints = %{
      num_tokens: Enum.map(rows, &length(&1.ids)),
      prompt_tokens: stats.prompt_tokens,
      padding: Output.paddings(stats.prompt_tokens),
      batch_size: List.duplicate(n, n),
      forced_tokens: Map.get(stats, :forced_tokens, []) |> pad_list(n)
    }

    fields =
      Map.new(@int_fields, fn name -> {name, {{:s, 32}, {n}, s32(Map.fetch!(ints, name))}} end)

    fields =
      Enum.reduce(@float_fields, fields, fn name, acc ->
        value = Map.fetch!(stats, name) / 1
        Map.put(acc, name, {{:f, 64}, {n}, f64(List.duplicate(value, n))})
      end)

    codes = for %{finish_reason: reason} <- rows, into: <<>>, do: <<@finish_codes[reason]::8>>

    {paths, paths_size} = encode_paths(Result.paths(stats))

    Map.merge(fields, %{
      token_ids: {{:s, 32}, {n, max_new_tokens}, token_ids},
      finish_reason: {{:u, 8}, {n}, codes},
      paths: {{:u, 8}, {n, @paths_width}, :binary.copy(paths, n)},
      paths_size: {{:s, 32}, {n}, s32(List.duplicate(paths_size, n))}
    })
  end

  defp pad_list(list, n), do: Enum.take(list ++ List.duplicate(0, n), n)

  # Fallback reasons are dropped from the end in the unlikely case they do
  # not fit; the paths themselves are short names.
  defp encode_paths(paths) do
    binary = :erlang.term_to_binary(paths)

    cond do
      byte_size(binary) <= @paths_width ->
        {binary <> :binary.copy(<<0>>, @paths_width - byte_size(binary)), byte_size(binary)}

      is_list(paths.fallbacks) and paths.fallbacks != [] ->
        encode_paths(%{paths | fallbacks: Enum.drop(paths.fallbacks, -1)})

      true ->
        encode_paths(%{paths | decode_path: nil, prefill_path: nil, fallbacks: nil})
    end
  end

  defp decode_paths(paths, sizes) do
    for {size, row} <- Enum.with_index(from_s32(sizes)) do
      paths |> binary_part(row * @paths_width, size) |> :erlang.binary_to_term([:safe])
    end
  end

  @doc """
  The rows of a caller's slice of the results (each field's binary, as
  `encode/3` laid it out): their ids, finish reason, prompt length, padding
  and their execution's metadata.
  """
  @spec decode(%{atom() => binary()}, pos_integer()) :: [map()]
  def decode(fields, max_new_tokens) do
    ints = Map.new(@int_fields, fn name -> {name, from_s32(Map.fetch!(fields, name))} end)
    floats = Map.new(@float_fields, fn name -> {name, from_f64(Map.fetch!(fields, name))} end)
    ids = from_s32(fields.token_ids) |> Enum.chunk_every(max_new_tokens)
    reasons = for <<code::8 <- fields.finish_reason>>, do: Map.fetch!(@finish_reasons, code)
    columns = Map.merge(ints, floats)
    names = Map.keys(columns)

    paths = decode_paths(fields.paths, fields.paths_size)

    [ids, reasons, paths | Enum.map(names, &Map.fetch!(columns, &1))]
    |> Enum.zip_with(fn [ids, reason, paths | values] ->
      values = Map.new(Enum.zip(names, values))
      count = values.num_tokens

      %{
        ids: Enum.take(ids, count),
        finish_reason: reason,
        prompt_tokens: values.prompt_tokens,
        padding: values.padding,
        metadata:
          Map.merge(paths, %{
            prompt_tokens: values.prompt_tokens,
            generated_tokens: count,
            forced_tokens: values.forced_tokens,
            batch_size: values.batch_size,
            prefill_ms: values.prefill_ms,
            decode_ms: values.decode_ms,
            decode_tokens_per_s: values.decode_tokens_per_s,
            time_to_first_token_ms: values.time_to_first_token_ms,
            total_ms: values.total_ms
          })
      }
    end)
  end

  defp s32(list), do: for(value <- list, into: <<>>, do: <<value::signed-native-32>>)
  defp f64(list), do: for(value <- list, into: <<>>, do: <<value::float-native-64>>)
  defp from_s32(binary), do: for(<<value::signed-native-32 <- binary>>, do: value)
  defp from_f64(binary), do: for(<<value::float-native-64 <- binary>>, do: value)
end
