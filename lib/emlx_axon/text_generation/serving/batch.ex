defmodule EMLXAxon.TextGeneration.Serving.Batch do
  @moduledoc false
  # How requests travel from a serving's callers to its executions, without
  # Nx: the serving adapter only wraps these binaries in tensors.
  #
  # Nx.Serving merges the batches of several callers, so the rows of one
  # batch key must have one width. Prompts are padded on the right to a
  # length bucket -- the smallest that fits the longest prompt -- and the
  # bucket is the batch key, so prompts of different buckets never share an
  # execution. Buckets are `compile: [sequence_length: ...]` when given,
  # else powers of two up to :max_len. The padding is stripped again before
  # generating: the engine aligns rows itself.
  #
  # Per-input constraints (a JSON Schema, regex or grammar) travel inside
  # the batch too, as one row of UTF-8 bytes per request with its byte size
  # and kind: whatever carries a request to its execution must be in the
  # batch, since Nx.Serving merges callers' batches and keeps nothing else
  # of them (a table of constraints beside the batch would have to outlive
  # callers that vanish, and exist on the node that runs the execution).
  # Merged rows must share a width, so the constraint row is padded to a
  # bucket (powers of 4 from 256 bytes to 4 MiB) and the bucket joins the
  # batch key: `{:sequence_length, w, :constraint_bytes, c}`. A batch with
  # no constraint at all keeps the plain `{:sequence_length, w}` key and no
  # constraint fields, so unconstrained traffic batches as before. Within
  # one caller's list, free and constrained inputs share the execution.

  @min_bucket 16
  @no_seed -1
  @constraint_buckets Enum.map(0..7, &(256 * Integer.pow(4, &1)))
  @constraint_kinds %{json_schema: 1, regex: 2, grammar: 3}
  @constraint_names Map.new(@constraint_kinds, fn {name, code} -> {code, name} end)

  @typedoc "A request as EMLXAxon.TextGeneration.Input builds it."
  @type request :: %{
          required(:ids) => [non_neg_integer()],
          required(:seed) => nil | non_neg_integer(),
          optional(:constraint) => nil | {atom(), String.t()}
        }

  @type key ::
          {:sequence_length, pos_integer()}
          | {:sequence_length, pos_integer(), :constraint_bytes, pos_integer()}

  @doc "The prompt length buckets, ascending."
  @spec buckets(map()) :: [pos_integer()]
  def buckets(%{compile: compile, max_len: max_len}) do
    case compile[:sequence_length] do
      nil -> power_buckets(max_len)
      lengths -> lengths |> List.wrap() |> Enum.uniq() |> Enum.sort()
    end
  end

  defp power_buckets(max_len) do
    @min_bucket
    |> Stream.iterate(&(&1 * 2))
    |> Enum.take_while(&(&1 < max_len))
    |> Kernel.++([max_len])
  end

  @doc """
  Every batch key, for `Nx.Serving.process_options/2`: one per length
  bucket of `buckets/1`, and one per length bucket and constraint bucket.
  """
  @spec batch_keys(map()) :: [key()]
  def batch_keys(opts) do
    widths = buckets(opts)
    plain = Enum.map(widths, &{:sequence_length, &1})

    plain ++
      for w <- widths, c <- @constraint_buckets, do: {:sequence_length, w, :constraint_bytes, c}
  end

  @doc "The batch key of `requests` padded to `width` (see `encode/2`)."
  @spec key([request()], pos_integer()) :: key()
  def key(requests, width) do
    case constraint_width!(requests) do
      nil -> {:sequence_length, width}
      bytes -> {:sequence_length, width, :constraint_bytes, bytes}
    end
  end

  # The constraint bucket of `requests`, nil when none is constrained.
  defp constraint_width!(requests) do
    longest =
      requests
      |> Enum.map(fn request ->
        case Map.get(request, :constraint) do
          nil -> nil
          {_kind, text} -> byte_size(text)
        end
      end)
      |> Enum.reject(&is_nil/1)
      |> Enum.max(fn -> nil end)

    cond do
      longest == nil ->
        nil

      bucket = Enum.find(@constraint_buckets, &(&1 >= longest)) ->
        bucket

      true ->
        raise ArgumentError,
              "a serving takes a :json_schema, :regex or :grammar of at most " <>
                "#{List.last(@constraint_buckets)} bytes per input, got one of #{longest}"
    end
  end

  @doc """
  The width (bucket) the prompts of `requests` are padded to. Raises an
  `EMLXAxon.Error` of kind `:prompt_too_long` when a prompt leaves no
  room to generate within `:max_len`, or is longer than every bucket.
  """
  @spec width!([request()], map()) :: pos_integer()
  def width!(requests, opts) do
    longest = requests |> Enum.map(&length(&1.ids)) |> Enum.max()

    if longest >= opts.max_len do
      raise EMLXAxon.Error,
        kind: :prompt_too_long,
        message:
          "prompt has #{longest} tokens but max_len is #{opts.max_len}: " <>
            "it must leave room for at least one generated token"
    end

    case Enum.find(buckets(opts), &(&1 >= longest)) do
      nil ->
        raise EMLXAxon.Error,
          kind: :prompt_too_long,
          message:
            "prompt has #{longest} tokens, more than the longest compiled " <>
              "sequence_length (#{opts |> buckets() |> List.last()})"

      width ->
        width
    end
  end

  @doc """
  Encodes `requests` as native-endian binaries: `input_ids` (s32, one row
  of `width` ids per request, zero-padded), `length` (s32) and `seed` (s64,
  -1 for none). When a request is constrained, also `constraint` (u8, one
  row per request of the bucket `key/2` names: the schema, regex or
  grammar text, zero-padded), `constraint_size` (s32, its bytes) and
  `constraint_kind` (u8: 0 for none, then `:json_schema`, `:regex`,
  `:grammar`).
  """
  @spec encode([request()], pos_integer()) :: %{atom() => binary()}
  def encode(requests, width) do
    input_ids =
      for %{ids: ids} <- requests, into: <<>> do
        row = for id <- ids, into: <<>>, do: <<id::signed-native-32>>
        [row, :binary.copy(<<0::signed-native-32>>, width - length(ids))] |> IO.iodata_to_binary()
      end

    fields = %{
      input_ids: input_ids,
      length: for(%{ids: ids} <- requests, into: <<>>, do: <<length(ids)::signed-native-32>>),
      seed: for(%{seed: seed} <- requests, into: <<>>, do: <<seed || @no_seed::signed-native-64>>)
    }

    case constraint_width!(requests) do
      nil -> fields
      bytes -> Map.merge(fields, encode_constraints(requests, bytes))
    end
  end

  defp encode_constraints(requests, bytes) do
    {rows, sizes, kinds} =
      requests
      |> Enum.map(fn request ->
        case Map.get(request, :constraint) do
          nil ->
            {:binary.copy(<<0>>, bytes), 0, 0}

          {kind, text} ->
            {[text, :binary.copy(<<0>>, bytes - byte_size(text))], byte_size(text),
             Map.fetch!(@constraint_kinds, kind)}
        end
      end)
      |> Enum.reduce({[], [], []}, fn {row, size, kind}, {rows, sizes, kinds} ->
        {[rows, row], [sizes, <<size::signed-native-32>>], [kinds, <<kind::8>>]}
      end)

    %{
      constraint: IO.iodata_to_binary(rows),
      constraint_size: IO.iodata_to_binary(sizes),
      constraint_kind: IO.iodata_to_binary(kinds)
    }
  end

  @doc """
  Decodes the first `size` rows of an execution's batch (the binaries of
  `encode/2`, possibly merged from several callers and padded) back into
  requests.
  """
  @spec decode(%{atom() => binary()}, pos_integer(), pos_integer()) :: [request()]
  def decode(%{input_ids: input_ids, length: lengths, seed: seeds} = fields, width, size) do
    lengths = for <<length::signed-native-32 <- lengths>>, do: length
    seeds = for <<seed::signed-native-64 <- seeds>>, do: if(seed == @no_seed, do: nil, else: seed)
    constraints = decode_constraints(fields, length(lengths))

    [lengths, seeds, constraints]
    |> Enum.zip()
    |> Enum.take(size)
    |> Enum.with_index()
    |> Enum.map(fn {{length, seed, constraint}, row} ->
      ids = binary_part(input_ids, row * width * 4, length * 4)
      %{ids: for(<<id::signed-native-32 <- ids>>, do: id), seed: seed, constraint: constraint}
    end)
  end

  defp decode_constraints(
         %{constraint: texts, constraint_size: sizes, constraint_kind: kinds},
         rows
       ) do
    bytes = div(byte_size(texts), rows)
    sizes = for <<size::signed-native-32 <- sizes>>, do: size

    for {{size, kind}, row} <- Enum.with_index(Enum.zip(sizes, :binary.bin_to_list(kinds))) do
      if kind != 0 do
        {Map.fetch!(@constraint_names, kind), binary_part(texts, row * bytes, size)}
      end
    end
  end

  defp decode_constraints(_fields, rows), do: List.duplicate(nil, rows)

  # Room for a pid's external term with any node name.
  @caller_width 320

  @doc """
  The processes waiting for `count` rows (the calling process's) as one
  row of bytes each, for a static execution to see whether anyone still
  waits for its rows.
  """
  @spec encode_callers(pid(), pos_integer()) :: {binary(), {pos_integer(), pos_integer()}}
  def encode_callers(pid, count) do
    binary = :erlang.term_to_binary(pid)
    row = binary <> :binary.copy(<<0>>, @caller_width - byte_size(binary))
    {:binary.copy(row, count), {count, @caller_width}}
  end

  @doc "The first `size` callers of `encode_callers/2`'s rows (merged and padded)."
  @spec decode_callers(binary(), non_neg_integer()) :: [pid() | nil]
  def decode_callers(binary, size) do
    for <<row::binary-size(@caller_width) <- binary>> do
      case row do
        <<0, _::binary>> -> nil
        row -> :erlang.binary_to_term(row)
      end
    end
    |> Enum.take(size)
  end

  @doc """
  The rows (indices into `callers`, one caller a row) whose caller has
  exited: a local process that is no longer alive. Unknown callers (`nil`,
  or on another node) count as waiting.
  """
  @spec gone_rows([pid() | nil]) :: [non_neg_integer()]
  def gone_rows(callers) do
    for {caller, row} <- Enum.with_index(callers),
        is_pid(caller) and node(caller) == node() and not Process.alive?(caller),
        do: row
  end
end
