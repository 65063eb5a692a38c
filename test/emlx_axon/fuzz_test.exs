defmodule EMLXAxon.FuzzTest do
  # Seeded fuzzing of the two files a checkpoint's loading parses first:
  # safetensors headers and config.json. Every case is built to be invalid,
  # so every load must return {:error, %EMLXAxon.Error{}}: never succeed,
  # raise, hang or take the VM down.
  use ExUnit.Case, async: true

  alias EMLXAxon.{Error, JSON, TestCheckpoint, TestFixtures}
  alias EMLXAxon.Qwen3.Loader

  @moduletag :fixtures
  @moduletag :reliability
  @moduletag timeout: 300_000

  @fixture "qwen3-4bit-g64"
  @cases 200

  # Bytes per element of each safetensors dtype.
  @dtype_sizes %{
    "BOOL" => 1,
    "U8" => 1,
    "I8" => 1,
    "F8_E5M2" => 1,
    "F8_E4M3" => 1,
    "I16" => 2,
    "U16" => 2,
    "F16" => 2,
    "BF16" => 2,
    "I32" => 4,
    "U32" => 4,
    "F32" => 4,
    "F64" => 8,
    "I64" => 8,
    "U64" => 8
  }
  @junk_dtypes ["", "bf16", "F128", "Q4", "float32", "U4"]

  setup_all do
    path = Path.join(TestFixtures.path(@fixture), "model.safetensors")
    <<size::little-64, header::binary-size(size), data::binary>> = File.read!(path)
    %{header: EMLXAxon.TestJSON.decode!(header), data: data}
  end

  setup do
    dir = TestCheckpoint.scratch_copy(@fixture)
    # Keep the index out: it would name the weights file before it is parsed.
    File.rm!(Path.join(dir, "model.safetensors.index.json"))
    %{dir: dir}
  end

  test "#{@cases} broken safetensors files", %{dir: dir} = context do
    :rand.seed(:exsss, {2024, 11, 30})
    path = Path.join(dir, "model.safetensors")

    results =
      for i <- 1..@cases do
        {kind, bytes} = safetensors_case(rem(i, 4), context)
        File.write!(path, bytes)
        {kind, assert_load_fails(dir, kind, i)}
      end

    report("safetensors", results)
  end

  test "#{@cases} broken config.json files", %{dir: dir} do
    :rand.seed(:exsss, {1, 2, 3})
    config = TestCheckpoint.read_config(dir)

    results =
      for i <- 1..@cases do
        {kind, bytes} = config_case(rem(i, 4), config)
        File.write!(Path.join(dir, "config.json"), bytes)
        {kind, assert_load_fails(dir, kind, i)}
      end

    report("config.json", results)
  end

  # Every family of cases ran; prints which errors they met.
  defp report(what, results) do
    families = results |> Enum.map(fn {kind, _} -> family(kind) end) |> Enum.uniq()
    assert length(families) == 4

    errors = results |> Enum.frequencies_by(&elem(&1, 1)) |> Enum.sort()
    IO.puts("\n#{length(results)} broken #{what} files, all refused: #{inspect(errors)}")
  end

  defp family({:mutated, _}), do: :mutated
  defp family(kind), do: kind

  defp assert_load_fails(dir, kind, i) do
    case Loader.load(dir) do
      {:error, %Error{kind: error_kind, message: message}} ->
        assert is_atom(error_kind) and is_binary(message)
        refute error_kind == :panic, "case #{i} (#{inspect(kind)}) panicked: #{message}"
        error_kind

      {:ok, _state} ->
        flunk("case #{i} (#{inspect(kind)}) loaded")
    end
  end

  ## Safetensors cases

  # Any length prefix, then garbage.
  defp safetensors_case(0, _context) do
    length =
      Enum.random([
        :rand.uniform(2 ** 64) - 1,
        :rand.uniform(4096),
        0,
        2 ** 63,
        2 ** 64 - 1
      ])

    {:random_prefix, [<<length::little-64>>, random_bytes(:rand.uniform(2048) - 1)]}
  end

  # A correct length prefix around garbage bytes.
  defp safetensors_case(1, _context) do
    header = random_bytes(:rand.uniform(1024))
    {:random_header, [<<byte_size(header)::little-64>>, header, random_bytes(:rand.uniform(512))]}
  end

  # A JSON header shaped like safetensors' (it cannot name every tensor a
  # model needs, so it cannot load).
  defp safetensors_case(2, _context) do
    header =
      Map.new(1..:rand.uniform(5), fn _ ->
        {Enum.random([random_string(), "model.norm.weight", "__metadata__"]), random_entry()}
      end)

    header = JSON.encode!(header)
    {:json_header, [<<byte_size(header)::little-64>>, header, random_bytes(:rand.uniform(4096))]}
  end

  # The real header with one entry broken, and the real data.
  defp safetensors_case(3, %{header: header, data: data}) do
    name = header |> Map.keys() |> List.delete("__metadata__") |> Enum.random()
    {mutation, header} = mutate_entry(header, name)
    {{:mutated, mutation}, [<<byte_size(header)::little-64>>, header, data]}
  end

  defp random_entry do
    entry = %{
      "dtype" => Enum.random(Map.keys(@dtype_sizes) ++ @junk_dtypes),
      "shape" => Enum.map(1..:rand.uniform(4), fn _ -> random_int() end),
      "data_offsets" => [random_int(), random_int()]
    }

    Enum.random([entry, Map.delete(entry, Enum.random(Map.keys(entry))), random_json(0)])
  end

  # Breaks entry `name` of `header` so that no reading of it is valid;
  # returns the mutation and the encoded header.
  defp mutate_entry(header, name) do
    %{"dtype" => dtype, "data_offsets" => [from, to]} = entry = header[name]

    case Enum.random([:dtype, :shape, :offsets, :drop_field, :replace, :rename, :truncate]) do
      :dtype ->
        # Another element size (the data no longer fits) or no dtype at all.
        sizes = for {d, size} <- @dtype_sizes, size != @dtype_sizes[dtype], do: d
        {:dtype, encode_with(header, name, "dtype", Enum.random(sizes ++ @junk_dtypes))}

      :shape ->
        shape = random_shape(&(element_bytes(&1, dtype) != to - from))
        {:shape, encode_with(header, name, "shape", shape)}

      :offsets ->
        # Offsets no tensor has leave the file's data not exactly covered.
        taken = for {_, %{"data_offsets" => offsets}} <- header, do: offsets
        offsets = random_offsets(&(&1 not in taken))
        {:offsets, encode_with(header, name, "data_offsets", offsets)}

      :drop_field ->
        entry = Map.delete(entry, Enum.random(Map.keys(entry)))
        {:drop_field, header |> Map.put(name, entry) |> JSON.encode!()}

      :replace ->
        {:replace, header |> Map.put(name, random_json(0)) |> JSON.encode!()}

      :rename ->
        {:rename, header |> Map.delete(name) |> Map.put(random_string(), entry) |> JSON.encode!()}

      :truncate ->
        json = JSON.encode!(header)
        {:truncate, binary_part(json, 0, :rand.uniform(byte_size(json) - 1))}
    end
  end

  defp encode_with(header, name, field, value),
    do: header |> put_in([name, field], value) |> JSON.encode!()

  defp random_shape(valid?) do
    shape = Enum.map(0..(:rand.uniform(4) - 1), fn _ -> random_int() end)
    if valid?.(shape), do: shape, else: random_shape(valid?)
  end

  defp random_offsets(valid?) do
    offsets = [random_int(), random_int()]
    if valid?.(offsets), do: offsets, else: random_offsets(valid?)
  end

  # The byte size of a shape, or nil when it is not a list of naturals.
  defp element_bytes(shape, dtype) do
    if Enum.all?(shape, &(is_integer(&1) and &1 >= 0)),
      do: Enum.product(shape) * @dtype_sizes[dtype],
      else: nil
  end

  ## Config cases

  # Garbage bytes (rarely even JSON).
  defp config_case(0, _config), do: {:random_bytes, random_bytes(:rand.uniform(512) - 1)}

  # Random JSON: not an object, or one without the required keys.
  defp config_case(1, _config), do: {:random_json, JSON.encode!(random_json(0))}

  # The real config with one required key removed or given a bad value.
  defp config_case(2, config) do
    key = Enum.random(Map.keys(required_keys()))

    # Without head_dim or quantization the fixture still loads: head_dim is
    # derived, and quantization_config stands in for quantization.
    config =
      if :rand.uniform(5) == 1 and key not in ["head_dim", "quantization"],
        do: Map.delete(config, key),
        else: Map.put(config, key, bad_value(key, config[key]))

    {{:mutated, key}, JSON.encode!(config)}
  end

  # Nesting deeper than any JSON parser should recurse.
  defp config_case(3, _config) do
    depth = 1000 + :rand.uniform(100_000)
    {open, close} = Enum.random([{"[", "]"}, {~s({"a":), "}"}])
    {:deep, [:binary.copy(open, depth), "1", :binary.copy(close, depth)]}
  end

  # Keys whose every value but the fixture's breaks loading: each is either
  # parsed strictly or checked against the weights' shapes.
  defp required_keys do
    %{
      "model_type" => :string,
      "hidden_size" => :int,
      "num_attention_heads" => :int,
      "num_key_value_heads" => :int,
      "intermediate_size" => :int,
      "vocab_size" => :int,
      "num_hidden_layers" => :more_layers,
      "head_dim" => :int,
      "quantization" => :quantization,
      "rope_theta" => :number
    }
  end

  defp bad_value(key, current) do
    value =
      case required_keys()[key] do
        :string ->
          Enum.random([random_string(), random_json(0)])

        :int ->
          Enum.random([random_int(), random_json(0)])

        # Fewer layers than stored would load (the rest is ignored).
        :more_layers ->
          Enum.random([current + :rand.uniform(2 ** 40), random_int(), random_json(0)])

        :number ->
          Enum.random([random_string(), [1], %{}, true])

        :quantization ->
          bad_quantization(current)
      end

    if valid_replacement?(key, value, current), do: bad_value(key, current), else: value
  end

  defp bad_quantization(current) do
    case :rand.uniform(3) do
      1 -> Map.put(current, "bits", random_int())
      2 -> Map.put(current, "group_size", random_int())
      3 -> random_json(0)
    end
  end

  # The few random values that would still load the fixture.
  defp valid_replacement?(_key, value, value), do: true
  defp valid_replacement?("model_type", value, _), do: value in ["qwen3", "qwen2"]

  defp valid_replacement?("num_hidden_layers", value, current),
    do: is_integer(value) and value in 1..current

  defp valid_replacement?(key, nil, _), do: key in ["head_dim", "quantization"]
  defp valid_replacement?(_key, _value, _current), do: false

  ## Random values

  defp random_bytes(n), do: :rand.bytes(n)

  defp random_int do
    Enum.random([
      0,
      -1,
      1,
      :rand.uniform(1000),
      -:rand.uniform(1000),
      :rand.uniform(2 ** 31),
      2 ** 31,
      2 ** 32,
      2 ** 63 - 1,
      2 ** 64,
      :rand.uniform(2 ** 70)
    ])
  end

  defp random_string do
    for _ <- 1..:rand.uniform(12),
        into: "",
        do: <<Enum.random(~c"abcdefghijklmnopqrstuvwxyz._0123456789ü")::utf8>>
  end

  defp random_json(depth) when depth > 3,
    do: Enum.random([nil, true, random_int(), random_string()])

  defp random_json(depth) do
    case :rand.uniform(8) do
      1 -> nil
      2 -> Enum.random([true, false])
      3 -> random_int()
      4 -> :rand.uniform() * Enum.random([1, -1, 1.0e30])
      5 -> random_string()
      6 -> Enum.random(Map.keys(@dtype_sizes) ++ @junk_dtypes)
      7 -> Enum.map(1..:rand.uniform(4)//1, fn _ -> random_json(depth + 1) end)
      8 -> Map.new(1..:rand.uniform(4)//1, fn _ -> {random_string(), random_json(depth + 1)} end)
    end
  end
end
