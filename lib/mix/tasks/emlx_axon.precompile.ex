defmodule Mix.Tasks.EmlxAxon.Precompile do
  @shortdoc "Packs the native part as a precompiled artifact"

  @moduledoc """
  Builds the native part from source (as `mix compile` does, for the
  backend `EMLX_AXON_BACKEND` or `config :emlx_axon, backend: ...` selects)
  and packs `priv/native/` (the NIF, libmlx and what the backend needs at
  run time) as a versioned artifact for this target and backend:

      mix emlx_axon.precompile
      mix emlx_axon.precompile --out /tmp/artifacts --checksum-file /tmp/artifacts/checksum-emlx_axon.exs

  It writes `emlx_axon-v<version>-nif-<nif version>-<target>-<backend>.tar.gz`
  and its `.sha256` into `--out` (default: `_build/precompiled`), and
  records the sha256 in the checksum file (default: `checksum-emlx_axon.exs`
  in the project root, which ships with the package), keeping the entries
  of other targets. Serve the artifacts from a URL or a folder and point
  `EMLX_AXON_PRECOMPILED` at it to install them without Rust or Python.
  """

  use Mix.Task

  alias EMLXAxon.MixNative.{Bundle, Precompiled}

  @switches [out: :string, checksum_file: :string]

  @impl Mix.Task
  def run(args) do
    {opts, rest, invalid} = OptionParser.parse(args, strict: @switches)

    if invalid != [] or rest != [] do
      Mix.raise("usage: mix emlx_axon.precompile [--out DIR] [--checksum-file PATH]")
    end

    if Precompiled.source() do
      Mix.raise(
        "EMLX_AXON_PRECOMPILED is set: unset it, so that the artifact is built from source"
      )
    end

    root = File.cwd!()
    Mix.Task.run("compile.emlx_axon_native", [])
    native_dir = Mix.Tasks.Compile.EmlxAxonNative.native_dir(root)

    info =
      case Bundle.read_info(native_dir) do
        {:ok, info} ->
          info

        :error ->
          Mix.raise("#{native_dir} has no #{Bundle.info_file()}: run `mix compile --force`")
      end

    version = Mix.Project.config()[:version]
    name = Bundle.artifact_name(version, info.target, info.backend)
    out = Path.expand(opts[:out] || Path.join(Mix.Project.build_path(), "../precompiled"))
    tarball = Path.join(out, name)

    Bundle.pack!(native_dir, tarball)

    sha = Bundle.sha256(File.read!(tarball))

    File.write!(tarball <> ".sha256", "#{sha}  #{name}\n")

    checksum_file =
      Path.expand(opts[:checksum_file] || Path.join(root, Precompiled.checksum_file()))

    record_checksum!(checksum_file, name, sha)

    Mix.shell().info("""
    Wrote #{tarball} (#{div(File.stat!(tarball).size, 1024 * 1024)} MiB, sha256 #{sha})
    and recorded it in #{checksum_file}.\
    """)
  end

  defp record_checksum!(path, name, sha) do
    checksums =
      if File.regular?(path) do
        case Code.eval_file(path) do
          {map, _binding} when is_map(map) -> map
          _ -> Mix.raise("#{path} must hold a map of artifact names to \"sha256:...\"")
        end
      else
        %{}
      end

    checksums = Map.put(checksums, name, "sha256:" <> sha)
    File.mkdir_p!(Path.dirname(path))

    File.write!(path, [
      checksums |> inspect(limit: :infinity) |> Code.format_string!(),
      "\n"
    ])
  end
end
