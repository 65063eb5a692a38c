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

  @min_bucket 16
  @no_seed -1

  @typedoc "A request as EMLXAxon.TextGeneration.Input builds it."
  @type request :: %{ids: [non_neg_integer()], seed: nil | non_neg_integer()}

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

  @doc "The batch keys of `buckets/1`, for `Nx.Serving.process_options/2`."
  @spec batch_keys(map()) :: [{:sequence_length, pos_integer()}]
  def batch_keys(opts), do: Enum.map(buckets(opts), &{:sequence_length, &1})

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
  -1 for none).
  """
  @spec encode([request()], pos_integer()) :: %{
          input_ids: binary(),
          length: binary(),
          seed: binary()
        }
  def encode(requests, width) do
    input_ids =
      for %{ids: ids} <- requests, into: <<>> do
        row = for id <- ids, into: <<>>, do: <<id::signed-native-32>>
        [row, :binary.copy(<<0::signed-native-32>>, width - length(ids))] |> IO.iodata_to_binary()
      end

    %{
      input_ids: input_ids,
      length: for(%{ids: ids} <- requests, into: <<>>, do: <<length(ids)::signed-native-32>>),
      seed: for(%{seed: seed} <- requests, into: <<>>, do: <<seed || @no_seed::signed-native-64>>)
    }
  end

  @doc """
  Decodes the first `size` rows of an execution's batch (the binaries of
  `encode/2`, possibly merged from several callers) back into requests.
  """
  @spec decode(
          %{input_ids: binary(), length: binary(), seed: binary()},
          pos_integer(),
          pos_integer()
        ) ::
          [request()]
  def decode(%{input_ids: input_ids, length: lengths, seed: seeds}, width, size) do
    lengths = for <<length::signed-native-32 <- lengths>>, do: length
    seeds = for <<seed::signed-native-64 <- seeds>>, do: if(seed == @no_seed, do: nil, else: seed)

    [lengths, seeds]
    |> Enum.zip()
    |> Enum.take(size)
    |> Enum.with_index()
    |> Enum.map(fn {{length, seed}, row} ->
      ids = binary_part(input_ids, row * width * 4, length * 4)
      %{ids: for(<<id::signed-native-32 <- ids>>, do: id), seed: seed}
    end)
  end
end
