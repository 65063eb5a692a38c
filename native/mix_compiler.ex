defmodule Mix.Tasks.Compile.EmlxAxonNative do
  @shortdoc "Builds the emlx_axon NIF with cargo"

  @moduledoc """
  Builds the `emlx_axon_nif` Rust crate and installs it as
  `priv/native/libemlx_axon_nif.so`.

  It runs `cargo build --release -p emlx_axon_nif` in the project root,
  then copies the built library into `priv/native/` atomically (to a
  temporary name in the same directory, then renamed over the old one),
  so a running VM never sees a half-written library.

  To keep no-op compiles fast, cargo is not run at all when nothing it
  reads has changed since the last build: the sources under `native/`,
  `Cargo.toml`, `Cargo.lock`, the built library, the MLX environment
  variables and the `scripts/setup` stamp are fingerprinted in a
  manifest. Pass `--force` (as in `mix compile --force`) to always run
  cargo, which is itself incremental.

  ## Environment

    * `CARGO` - the cargo executable (default: `cargo` on the `PATH`, then
      `~/.cargo/bin/cargo`)
    * `CARGO_TARGET_DIR` - cargo's target directory (default: `target/`)
    * `MLX_PREFIX`, `MLX_BACKEND` - passed through to the MLX build
    * `EMLX_AXON_SKIP_NATIVE=1` - skip this compiler entirely (for example
      to compile or document the Elixir code on a machine without MLX)

  Pass `--verbose` to see cargo's output as it builds; otherwise it is
  only printed when the build fails.
  """

  use Mix.Task.Compiler

  @crate "emlx_axon_nif"
  @lib_base "libemlx_axon_nif"
  @manifest "compile.emlx_axon_native"
  @manifest_vsn 1
  @env_vars ~w(MLX_PREFIX MLX_BACKEND CARGO CARGO_TARGET_DIR RUSTFLAGS)

  @impl Mix.Task.Compiler
  def run(args) do
    {opts, _rest, _invalid} =
      OptionParser.parse(args, switches: [force: :boolean, verbose: :boolean])

    root = project_root()
    installed = installed_path(root)

    result =
      if skip?() do
        unless File.exists?(installed) do
          Mix.shell().info([
            :yellow,
            "EMLX_AXON_SKIP_NATIVE is set and #{Path.relative_to(installed, root)} is missing: " <>
              "EMLXAxon.Native will not load until the NIF is built",
            :reset
          ])
        end

        :noop
      else
        build(root, installed, opts)
      end

    # priv/ may have just been created: (re)build the _build structure so it
    # is linked (or copied) into the application's build directory.
    Mix.Project.build_structure()
    {result, []}
  end

  @impl Mix.Task.Compiler
  def manifests, do: [manifest_path()]

  @impl Mix.Task.Compiler
  def clean do
    File.rm(manifest_path())
    File.rm(installed_path(project_root()))
    :ok
  end

  defp build(root, installed, opts) do
    fingerprint = fingerprint(root)

    if !opts[:force] and File.regular?(installed) and read_manifest() == fingerprint do
      :noop
    else
      cargo_build!(root, opts)
      changed? = install!(built_path(root), installed)
      # Fingerprint again: the build changed the library in target/.
      write_manifest(fingerprint(root))
      if changed?, do: :ok, else: :noop
    end
  end

  ## cargo

  defp cargo_build!(root, opts) do
    cargo = cargo_executable!()
    args = ["build", "--release", "-p", @crate]
    command = Enum.join(["cargo" | args], " ")

    Mix.shell().info("Compiling the emlx_axon NIF (#{command}); the first build takes minutes")

    into = if opts[:verbose], do: IO.stream(:stdio, :line), else: ""

    {output, status} =
      System.cmd(cargo, args, cd: root, stderr_to_stdout: true, into: into, env: cargo_env())

    if status != 0 do
      if is_binary(output), do: IO.write(:stderr, output)

      Mix.raise("""
      could not build the emlx_axon NIF: `#{command}` exited with status #{status} \
      (its output is above).

      To fix it:
        * run scripts/setup from the emlx_axon directory: it installs the system \
      packages, MLX and the Rust-side prerequisites, then run `mix compile` again;
        * or point MLX_PREFIX at an existing MLX installation;
        * EMLX_AXON_SKIP_NATIVE=1 compiles only the Elixir code (the NIF will not load).
      """)
    end

    built = built_path(root)

    unless File.regular?(built) do
      Mix.raise(
        "cargo reported success but #{built} does not exist; " <>
          "is CARGO_TARGET_DIR pointing somewhere else?"
      )
    end

    :ok
  end

  defp cargo_executable! do
    home_cargo = Path.expand("~/.cargo/bin/cargo")

    cond do
      (cargo = System.get_env("CARGO")) not in [nil, ""] ->
        cargo

      cargo = System.find_executable("cargo") ->
        cargo

      File.regular?(home_cargo) ->
        home_cargo

      true ->
        Mix.raise("""
        could not find cargo, which builds the emlx_axon NIF. Install Rust \
        (https://rustup.rs) or run scripts/setup, or set CARGO to the cargo executable.
        """)
    end
  end

  defp cargo_env do
    for var <- ["MLX_PREFIX", "MLX_BACKEND"], value = System.get_env(var), do: {var, value}
  end

  ## Installing the library

  # Returns true when the installed library was replaced.
  defp install!(source, dest) do
    %File.Stat{size: size, mtime: mtime} = File.stat!(source, time: :posix)

    case File.stat(dest, time: :posix) do
      {:ok, %File.Stat{size: ^size, mtime: ^mtime}} ->
        false

      _missing_or_different ->
        dir = Path.dirname(dest)
        File.mkdir_p!(dir)
        tmp = Path.join(dir, ".#{Path.basename(dest)}.#{System.unique_integer([:positive])}.tmp")

        try do
          File.cp!(source, tmp)
          File.touch!(tmp, mtime)
          File.rename!(tmp, dest)
        after
          File.rm(tmp)
        end

        true
    end
  end

  ## Fingerprint and manifest

  defp fingerprint(root) do
    native_files =
      root
      |> Path.join("native")
      |> files_under()
      |> Enum.map(&{Path.relative_to(&1, root), File.read!(&1)})

    top_files =
      for name <- ["Cargo.toml", "Cargo.lock"],
          path = Path.join(root, name),
          File.regular?(path),
          do: {name, File.read!(path)}

    built =
      case File.stat(built_path(root), time: :posix) do
        {:ok, %File.Stat{size: size, mtime: mtime}} -> {size, mtime}
        {:error, _} -> nil
      end

    setup_stamps = root |> Path.join(".venv/.emlx_axon-*") |> Path.wildcard()
    env = for var <- @env_vars, do: {var, System.get_env(var)}

    term = {@manifest_vsn, :os.type(), native_files, top_files, built, setup_stamps, env}
    :erlang.md5(:erlang.term_to_binary(term))
  end

  defp files_under(dir) do
    case File.ls(dir) do
      {:ok, names} ->
        names
        |> Enum.sort()
        |> Enum.reject(&(&1 in ["target", ".git"]))
        |> Enum.flat_map(fn name ->
          path = Path.join(dir, name)

          cond do
            File.dir?(path) -> files_under(path)
            File.regular?(path) -> [path]
            true -> []
          end
        end)

      {:error, _} ->
        []
    end
  end

  defp read_manifest do
    case File.read(manifest_path()) do
      {:ok, binary} -> binary
      {:error, _} -> nil
    end
  end

  defp write_manifest(fingerprint) do
    path = manifest_path()
    File.mkdir_p!(Path.dirname(path))
    File.write!(path, fingerprint)
  end

  defp manifest_path, do: Path.join(Mix.Project.manifest_path(), @manifest)

  ## Paths

  defp project_root do
    case Mix.Project.project_file() do
      nil -> File.cwd!()
      file -> Path.dirname(file)
    end
  end

  defp installed_path(root), do: Path.join([root, "priv", "native", @lib_base <> ".so"])

  defp built_path(root) do
    target =
      case System.get_env("CARGO_TARGET_DIR") do
        dir when dir in [nil, ""] -> Path.join(root, "target")
        dir -> Path.expand(dir, root)
      end

    ext = if match?({:unix, :darwin}, :os.type()), do: ".dylib", else: ".so"
    Path.join([target, "release", @lib_base <> ext])
  end

  defp skip? do
    System.get_env("EMLX_AXON_SKIP_NATIVE") not in [nil, "", "0", "false"]
  end
end
