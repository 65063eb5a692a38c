defmodule EMLXAxon.MixNative.Bundle do
  @moduledoc false
  # The native part as installed under priv/native/, self-contained so that
  # priv/ can be copied anywhere (a release, a precompiled artifact):
  #
  #   libemlx_axon_nif.so      the NIF, with RUNPATH $ORIGIN/mlx/lib
  #   mlx/lib/                 the MLX wheel's lib/ (libmlx, mlx.metallib)
  #   mlx/include/             CUDA only: the headers MLX's JIT compiles against
  #   mlx_*.libs/              the libraries bundled in the wheel, where
  #                            libmlx's own rpath ($ORIGIN/../../) looks
  #   emlx_axon_nif.info       what was built: backend, target, versions

  @nif "libemlx_axon_nif.so"
  @info "emlx_axon_nif.info"
  @nif_version "2.15"

  def nif_file, do: @nif
  def info_file, do: @info

  @doc false
  # Copies what the NIF needs at run time from the MLX `prefix` and writes
  # the info file. Returns true when something was replaced.
  def install!(native_dir, nif_built, prefix, backend, version) do
    nif_changed? = install_file!(nif_built, Path.join(native_dir, @nif))
    lib_changed? = sync_dir!(Path.join(prefix, "lib"), Path.join([native_dir, "mlx", "lib"]))

    bundled_changed? =
      prefix
      |> Path.dirname()
      |> Path.join("mlx*.libs")
      |> Path.wildcard()
      |> Enum.map(&sync_dir!(&1, Path.join(native_dir, Path.basename(&1))))
      |> Enum.any?()

    include_changed? =
      backend == :cuda and
        sync_dir!(Path.join(prefix, "include"), Path.join([native_dir, "mlx", "include"]))

    info = %{
      backend: backend,
      target: host_target(),
      nif_version: @nif_version,
      version: version,
      system_libraries: system_libraries(backend, Path.join([prefix, "lib", "libmlx.so"])),
      system_packages: system_packages(backend, prefix)
    }

    info_changed? = read_info(native_dir) != {:ok, info}
    if info_changed?, do: write_info!(native_dir, info)

    Enum.any?([nif_changed?, lib_changed?, bundled_changed?, include_changed?, info_changed?])
  end

  @doc false
  def complete?(native_dir) do
    File.regular?(Path.join(native_dir, @nif)) and File.regular?(Path.join(native_dir, @info)) and
      Path.wildcard(Path.join([native_dir, "mlx", "lib", "libmlx.*"])) != []
  end

  @doc false
  def read_info(native_dir) do
    case :file.consult(String.to_charlist(Path.join(native_dir, @info))) do
      {:ok, [info]} when is_map(info) -> {:ok, info}
      _ -> :error
    end
  end

  defp write_info!(native_dir, info) do
    File.mkdir_p!(native_dir)
    write_atomically!(Path.join(native_dir, @info), :io_lib.format("~p.~n", [info]))
  end

  # The CUDA libmlx links NVIDIA libraries that the wheel does not bundle (pip
  # installs them as nvidia-* packages); they must be found at run time.
  defp system_libraries(:cuda, libmlx) do
    with readelf when is_binary(readelf) <- System.find_executable("readelf"),
         {output, 0} <- System.cmd(readelf, ["-d", libmlx], stderr_to_stdout: true) do
      ~r/\(NEEDED\)\s+Shared library: \[([^\]]+)\]/
      |> Regex.scan(output, capture: :all_but_first)
      |> List.flatten()
      |> Enum.filter(&String.match?(&1, ~r/^lib(cu|nv|nccl)/))
    else
      _ -> []
    end
  end

  defp system_libraries(_backend, _libmlx), do: []

  # The wheel's own requirements name the pip packages with those libraries.
  defp system_packages(:cuda, prefix) do
    prefix
    |> Path.dirname()
    |> Path.join("mlx_cuda*.dist-info/METADATA")
    |> Path.wildcard()
    |> Enum.flat_map(&String.split(File.read!(&1), "\n"))
    |> Enum.flat_map(fn line ->
      case Regex.run(~r/^Requires-Dist: (nvidia-\S+)/, line) do
        [_, package] -> [package]
        nil -> []
      end
    end)
  end

  defp system_packages(_backend, _prefix), do: []

  ## Targets and artifacts

  @doc false
  # The target triple, as Rust names it (EMLX_AXON_TARGET overrides it).
  def target do
    case System.get_env("EMLX_AXON_TARGET") do
      target when target not in [nil, ""] -> target
      _ -> host_target()
    end
  end

  def host_target do
    [arch | rest] =
      :erlang.system_info(:system_architecture) |> List.to_string() |> String.split("-")

    arch = if arch == "arm64", do: "aarch64", else: arch

    case :os.type() do
      {:unix, :darwin} ->
        "#{arch}-apple-darwin"

      {:unix, :linux} ->
        if("musl" in rest, do: "#{arch}-unknown-linux-musl", else: "#{arch}-unknown-linux-gnu")

      {family, name} ->
        "#{arch}-#{family}-#{name}"
    end
  end

  def artifact_name(version, target, backend),
    do: "emlx_axon-v#{version}-nif-#{@nif_version}-#{target}-#{backend}.tar.gz"

  @doc false
  # A gzipped tarball of everything under native_dir, paths relative to it.
  def pack!(native_dir, tarball) do
    files =
      for path <- files_under(native_dir) do
        {String.to_charlist(Path.relative_to(path, native_dir)), String.to_charlist(path)}
      end

    File.mkdir_p!(Path.dirname(tarball))

    case :erl_tar.create(String.to_charlist(tarball), files, [:compressed]) do
      :ok -> :ok
      {:error, reason} -> Mix.raise("could not write #{tarball}: #{inspect(reason)}")
    end
  end

  def sha256(binary), do: :crypto.hash(:sha256, binary) |> Base.encode16(case: :lower)

  ## Files

  defp sync_dir!(source, dest) do
    source
    |> files_under()
    |> Enum.map(&install_file!(&1, Path.join(dest, Path.relative_to(&1, source))))
    |> Enum.any?()
  end

  # Every regular file below `dir`, sorted, skipping entries named in `skip`
  # at any depth.
  def files_under(dir, skip \\ []) do
    case File.ls(dir) do
      {:ok, names} ->
        names
        |> Enum.sort()
        |> Enum.reject(&(&1 in skip))
        |> Enum.flat_map(fn name ->
          path = Path.join(dir, name)

          cond do
            File.dir?(path) -> files_under(path, skip)
            File.regular?(path) -> [path]
            true -> []
          end
        end)

      {:error, _} ->
        []
    end
  end

  @doc false
  # Copies source to dest unless dest has its size and mtime already. The
  # copy is renamed into place, so a running VM never maps a partial file.
  def install_file!(source, dest) do
    %File.Stat{size: size, mtime: mtime} = File.stat!(source, time: :posix)

    case File.stat(dest, time: :posix) do
      {:ok, %File.Stat{size: ^size, mtime: ^mtime}} ->
        false

      _missing_or_different ->
        write_atomically!(dest, fn tmp ->
          File.cp!(source, tmp)
          File.touch!(tmp, mtime)
        end)

        true
    end
  end

  defp write_atomically!(dest, content) do
    dir = Path.dirname(dest)
    File.mkdir_p!(dir)
    tmp = Path.join(dir, ".#{Path.basename(dest)}.#{System.unique_integer([:positive])}.tmp")

    try do
      if is_function(content, 1), do: content.(tmp), else: File.write!(tmp, content)
      File.rename!(tmp, dest)
    after
      File.rm(tmp)
    end
  end
end
