defmodule EMLXAxon.TestCheckpoint do
  @moduledoc false
  # Scratch copies of fixture checkpoints, and a small safetensors reader
  # and writer, so tests can damage a real checkpoint in precise ways.

  alias EMLXAxon.{JSON, TestFixtures, TestJSON}

  # What the loader reads; the tokenizer and the mlx-lm references are left
  # out to keep copies cheap.
  @checkpoint_files ~w(config.json generation_config.json model.safetensors.index.json)

  @doc """
  A fresh folder (removed when the test ends) holding the checkpoint files of
  fixture `name`; `extra` names more files to copy, such as "tokenizer.json".
  """
  def scratch_copy(name, extra \\ []) do
    dir = scratch_dir()
    source = TestFixtures.path(name)

    for file <- File.ls!(source),
        file in @checkpoint_files or file in extra or weights?(file) do
      File.cp!(Path.join(source, file), Path.join(dir, file))
    end

    dir
  end

  @doc "An empty folder, removed when the test ends."
  def scratch_dir do
    dir = Path.join(System.tmp_dir!(), "emlx_axon_ckpt_#{System.unique_integer([:positive])}")
    File.mkdir_p!(dir)
    ExUnit.Callbacks.on_exit(fn -> File.rm_rf!(dir) end)
    dir
  end

  defp weights?(file),
    do: String.starts_with?(file, "model") and Path.extname(file) == ".safetensors"

  @doc "Reads `config.json` of `dir` as a map with string keys."
  def read_config(dir), do: dir |> Path.join("config.json") |> File.read!() |> TestJSON.decode!()

  @doc "Writes `config` (a map) as `config.json` of `dir`."
  def write_config(dir, config),
    do: File.write!(Path.join(dir, "config.json"), JSON.encode!(config))

  @doc "Rewrites `config.json` of `dir` through `fun`."
  def update_config(dir, fun), do: write_config(dir, fun.(read_config(dir)))

  @doc """
  Reads a safetensors file as `{tensors, metadata}`: tensors are
  `{name, dtype, shape, data}`, sorted by name.
  """
  def read_safetensors(path) do
    <<size::little-unsigned-64, rest::binary>> = File.read!(path)
    <<header::binary-size(size), data::binary>> = rest
    {metadata, entries} = header |> TestJSON.decode!() |> Map.pop("__metadata__")

    tensors =
      entries
      |> Enum.map(fn {name, %{"dtype" => dtype, "shape" => shape, "data_offsets" => [from, to]}} ->
        {name, dtype, shape, binary_part(data, from, to - from)}
      end)
      |> Enum.sort()

    {tensors, metadata}
  end

  @doc "Writes tensors (as `read_safetensors/1` returns them) as a safetensors file."
  def write_safetensors(path, tensors, metadata \\ nil) do
    {entries, _end} =
      Enum.map_reduce(tensors, 0, fn {name, dtype, shape, data}, offset ->
        entry = %{
          "dtype" => dtype,
          "shape" => shape,
          "data_offsets" => [offset, offset + byte_size(data)]
        }

        {{name, entry}, offset + byte_size(data)}
      end)

    header = Map.new(entries)
    header = if metadata, do: Map.put(header, "__metadata__", metadata), else: header
    write_raw_safetensors(path, JSON.encode!(header), Enum.map(tensors, &elem(&1, 3)))
  end

  @doc "Writes a safetensors file from a raw header (any bytes) and data."
  def write_raw_safetensors(path, header, data) do
    File.write!(path, [<<byte_size(header)::little-unsigned-64>>, header, data])
  end

  @doc """
  Rewrites `model.safetensors` of `dir` through `fun`, which gets and
  returns the tensor list of `read_safetensors/1`.
  """
  def update_weights(dir, fun) do
    path = Path.join(dir, "model.safetensors")
    {tensors, metadata} = read_safetensors(path)
    write_safetensors(path, fun.(tensors), metadata)
  end
end
