# What the compiler installs, and how: the backend, priv/native/'s layout,
# precompiled artifacts.
for file <- ~w(backend bundle precompiled), do: Code.require_file("mix/#{file}.ex", __DIR__)

defmodule Mix.Tasks.Compile.EmlxAxonNative do
  @shortdoc "Builds the emlx_axon NIF with cargo"

  @moduledoc """
  Builds (or installs a precompiled) native part of emlx_axon into
  `priv/native/`: the `emlx_axon_nif` Rust crate as
  `priv/native/libemlx_axon_nif.so`, with the MLX library it links and what
  that needs at run time (see `EMLXAxon.MixNative.Bundle`). The NIF finds
  libmlx relative to itself, so `priv/` works wherever it is copied, as in a
  `mix release`.

  ## From source

  It runs `cargo build --release -p emlx_axon_nif` in the project root
  (with `--features metal` for Metal), reads from cargo which MLX it linked,
  and copies the library and MLX into `priv/native/`, each file atomically
  (to a temporary name in the same directory, then renamed over the old
  one), so a running VM never sees a half-written library.

  To keep no-op compiles fast, cargo is not run at all when nothing it
  reads has changed since the last build: the sources under `native/`,
  `Cargo.toml`, `Cargo.lock`, the built library, the environment variables
  below and the `scripts/setup` stamp are fingerprinted in a manifest.
  Pass `--force` (as in `mix compile --force`) to always run cargo, which
  is itself incremental.

  ## Precompiled

  When `EMLX_AXON_PRECOMPILED` (or `config :emlx_axon, precompiled: ...`)
  is a base URL or a local folder, the artifact for this version, target and
  backend (made by `mix emlx_axon.precompile`) is fetched from there, its
  sha256 checked against `checksum-emlx_axon.exs` and unpacked into
  `priv/native/`: neither Rust nor Python is needed.

  ## Environment

    * `EMLX_AXON_BACKEND` - `cpu`, `cuda` or `metal` (or `config :emlx_axon,
      backend: ...`): the MLX backend; from source, the MLX found must be
      that backend's wheel (`MLX_BACKEND=... scripts/setup` installs it)
    * `EMLX_AXON_PRECOMPILED` - where precompiled artifacts are (see above)
    * `EMLX_AXON_TARGET` - the target triple of the artifact to install
      (default: this machine's)
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

  alias EMLXAxon.MixNative.{Backend, Bundle, Precompiled}

  @crate "emlx_axon_nif"
  @lib_base "libemlx_axon_nif"
  @manifest "compile.emlx_axon_native"
  @manifest_vsn 2
  @env_vars ~w(MLX_PREFIX MLX_BACKEND CARGO CARGO_TARGET_DIR RUSTFLAGS EMLX_AXON_BACKEND)

  @impl Mix.Task.Compiler
  def run(args) do
    {opts, _rest, _invalid} =
      OptionParser.parse(args, switches: [force: :boolean, verbose: :boolean])

    root = project_root()
    native_dir = native_dir(root)
    installed = Path.join(native_dir, Bundle.nif_file())

    result =
      cond do
        skip?() ->
          unless File.exists?(installed) do
            Mix.shell().info([
              :yellow,
              "EMLX_AXON_SKIP_NATIVE is set and #{Path.relative_to(installed, root)} is missing: " <>
                "EMLXAxon.Native will not load until the NIF is built",
              :reset
            ])
          end

          :noop

        source = Precompiled.source() ->
          install_precompiled(root, native_dir, source, opts)

        true ->
          build(root, native_dir, opts)
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
    File.rm_rf(native_dir(project_root()))
    :ok
  end

  ## Precompiled

  defp install_precompiled(root, native_dir, source, opts) do
    backend = Backend.requested!() || Backend.default()
    artifact = Precompiled.artifact!(root, version(), backend)
    fingerprint = :erlang.md5(:erlang.term_to_binary({@manifest_vsn, :precompiled, artifact}))

    if !opts[:force] and Bundle.complete?(native_dir) and read_manifest() == fingerprint do
      :noop
    else
      Precompiled.install!(source, artifact, native_dir)
      write_manifest(fingerprint)
      :ok
    end
  end

  ## From source

  defp build(root, native_dir, opts) do
    requested = Backend.requested!()
    fingerprint = fingerprint(root, requested)

    if !opts[:force] and Bundle.complete?(native_dir) and read_manifest() == fingerprint do
      :noop
    else
      features = Backend.cargo_features(requested || Backend.default())
      prefix = cargo_build!(root, features, opts)
      backend = Backend.for_prefix!(requested, prefix)
      changed? = Bundle.install!(native_dir, built_path(root), prefix, backend, version())
      report_system_libraries(native_dir)
      # Fingerprint again: the build changed the library in target/.
      write_manifest(fingerprint(root, requested))
      if changed?, do: :ok, else: :noop
    end
  end

  defp report_system_libraries(native_dir) do
    with {:ok, %{system_libraries: [_ | _]} = info} <- Bundle.read_info(native_dir) do
      Mix.shell().info(
        "priv/native/ holds MLX but not the NVIDIA libraries it links, which must be " <>
          "found at run time: #{Enum.join(info.system_libraries, ", ")} (libcuda comes " <>
          "with the NVIDIA driver; for the others: pip install " <>
          Enum.map_join(info.system_packages, " ", &"'#{&1}'") <>
          ", and put their lib/ folders on LD_LIBRARY_PATH)"
      )
    end
  end

  ## cargo

  # Builds the crate; returns the MLX prefix (the `mlx` package folder) that
  # mlx-sys linked, as cargo reports it.
  defp cargo_build!(root, features, opts) do
    cargo = cargo_executable!()
    args = ["build", "--release", "-p", @crate] ++ features
    command = Enum.join(["cargo" | args], " ")

    Mix.shell().info("Compiling the emlx_axon NIF (#{command}); the first build takes minutes")

    {lines, status} =
      run_cargo(
        cargo,
        args ++ ["--message-format=json-render-diagnostics"],
        root,
        opts[:verbose] == true
      )

    {messages, output} = Enum.split_with(lines, &String.starts_with?(&1, "{\"reason\":"))

    if status != 0 do
      unless opts[:verbose], do: Enum.each(output, &IO.puts(:stderr, &1))

      Mix.raise("""
      could not build the emlx_axon NIF: `#{command}` exited with status #{status} \
      (its output is above).

      To fix it:
        * run scripts/setup from the emlx_axon directory: it installs the system \
      packages, MLX and the Rust-side prerequisites, then run `mix compile` again;
        * or point MLX_PREFIX at an existing MLX installation;
        * or install a precompiled native part: set EMLX_AXON_PRECOMPILED (see the README);
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

    mlx_prefix!(messages)
  end

  # Runs cargo, collecting its lines and echoing the human ones (not cargo's
  # JSON messages) as they come when verbose.
  defp run_cargo(cargo, args, root, verbose?) do
    port =
      Port.open({:spawn_executable, cargo}, [
        :binary,
        :exit_status,
        :stderr_to_stdout,
        {:line, 65_536},
        args: args,
        cd: root,
        env: for({var, value} <- cargo_env(), do: {to_charlist(var), to_charlist(value)})
      ])

    collect(port, verbose?, [], "")
  end

  defp collect(port, verbose?, lines, partial) do
    receive do
      {^port, {:data, {:noeol, chunk}}} ->
        collect(port, verbose?, lines, partial <> chunk)

      {^port, {:data, {:eol, chunk}}} ->
        line = partial <> chunk
        if verbose? and not String.starts_with?(line, "{\"reason\":"), do: IO.puts(line)
        collect(port, verbose?, [line | lines], "")

      {^port, {:exit_status, status}} ->
        {Enum.reverse(lines), status}
    end
  end

  # mlx-sys reports the MLX lib/ it links as a native link path.
  defp mlx_prefix!(messages) do
    lib_dir =
      messages
      |> Enum.filter(&(&1 =~ ~s("reason":"build-script-executed") and &1 =~ "mlx-sys"))
      |> Enum.flat_map(fn message ->
        case Regex.run(~r/"linked_paths":\[([^\]]*)\]/, message) do
          [_, paths] -> Regex.scan(~r/"((?:[^"\\]|\\.)*)"/, paths, capture: :all_but_first)
          nil -> []
        end
      end)
      |> Enum.map(fn [path] -> Regex.replace(~r/\\(.)/, path, "\\1") end)
      |> Enum.map(&String.replace_prefix(&1, "native=", ""))
      |> Enum.find(&(Path.wildcard(Path.join(&1, "libmlx.*")) != []))

    lib_dir ||
      Mix.raise(
        "cargo built the NIF but did not report which MLX it linked " <>
          "(no mlx-sys link path holding libmlx); run `mix compile --force`"
      )

    Path.dirname(lib_dir)
  end

  defp cargo_executable! do
    home_cargo = Path.expand("~/.cargo/bin/cargo")

    cond do
      (cargo = System.get_env("CARGO")) not in [nil, ""] ->
        System.find_executable(cargo) || cargo

      cargo = System.find_executable("cargo") ->
        cargo

      File.regular?(home_cargo) ->
        home_cargo

      true ->
        Mix.raise("""
        could not find cargo, which builds the emlx_axon NIF. Install Rust \
        (https://rustup.rs) and run scripts/setup, or set CARGO to the cargo executable, \
        or install a precompiled native part (EMLX_AXON_PRECOMPILED, see the README).
        """)
    end
  end

  defp cargo_env do
    for var <- ["MLX_PREFIX", "MLX_BACKEND"], value = System.get_env(var), do: {var, value}
  end

  ## Fingerprint and manifest

  defp fingerprint(root, requested) do
    native_files =
      root
      |> Path.join("native")
      |> Bundle.files_under(["target", ".git"])
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

    term =
      {@manifest_vsn, :os.type(), native_files, top_files, built, setup_stamps, env, requested}

    :erlang.md5(:erlang.term_to_binary(term))
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

  defp version, do: Mix.Project.config()[:version]

  @doc false
  def native_dir(root), do: Path.join([root, "priv", "native"])

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
