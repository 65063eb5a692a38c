defmodule EMLXAxon.DistributionTest do
  # An application that depends on emlx_axon, built the ways users get it:
  # a `mix release` moved away from everything it was built from, and a
  # compile that installs a precompiled artifact over HTTP with no Rust and
  # no Python. Both use an artifact packed from this checkout's priv/native
  # by `mix emlx_axon.precompile`, so no Rust is rebuilt here.
  use ExUnit.Case, async: false

  alias EMLXAxon.TestFixtures

  @moduletag :fixtures
  @moduletag timeout: 600_000

  @root TestFixtures.root()
  @model "qwen3-4bit-g64"

  setup_all do
    tmp = Path.join(System.tmp_dir!(), "emlx_axon_dist_#{System.unique_integer([:positive])}")
    on_exit(fn -> File.rm_rf!(tmp) end)
    artifacts = Path.join(tmp, "artifacts")
    checksums = Path.join(artifacts, "checksum-emlx_axon.exs")

    Mix.Task.reenable("emlx_axon.precompile")

    ExUnit.CaptureIO.capture_io(fn ->
      Mix.Task.run("emlx_axon.precompile", ["--out", artifacts, "--checksum-file", checksums])
    end)

    [tarball] = Path.wildcard(Path.join(artifacts, "*.tar.gz"))
    # The backend priv/native was built for (the CPU, or CUDA on a GPU machine).
    {:ok, %{backend: backend} = info} = EMLXAxon.NativeBuild.read(Path.join(@root, "priv/native"))

    %{"prompt_ids" => prompt, "greedy_ids" => greedy} =
      TestFixtures.reference(@model)["prompts"]["plain"]

    %{
      tmp: tmp,
      artifacts: artifacts,
      tarball: tarball,
      backend: backend,
      library_path: system_library_path(Map.get(info, :system_libraries, [])),
      checksums: checksums,
      prompt: prompt,
      greedy: greedy
    }
  end

  test "the artifact: versioned per target and backend, with its sha256", ctx do
    name = Path.basename(ctx.tarball)
    version = Mix.Project.config()[:version]

    assert name =~
             ~r/^emlx_axon-v#{Regex.escape(version)}-nif-2\.15-x86_64-unknown-linux-gnu-#{ctx.backend}\.tar\.gz$/

    sha = :crypto.hash(:sha256, File.read!(ctx.tarball)) |> Base.encode16(case: :lower)
    assert File.read!(ctx.tarball <> ".sha256") == "#{sha}  #{name}\n"
    assert {%{^name => "sha256:" <> ^sha}, _} = Code.eval_file(ctx.checksums)

    {:ok, files} = :erl_tar.table(String.to_charlist(ctx.tarball), [:compressed])
    files = Enum.map(files, &List.to_string/1)

    for file <- ["libemlx_axon_nif.so", "emlx_axon_nif.info", "mlx/lib/libmlx.so"],
        do: assert(file in files)

    # The CPU wheel's bundled libraries; CUDA's headers for MLX's JIT.
    bundled = if ctx.backend == :cuda, do: "mlx/include/", else: "mlx_cpu.libs/"
    assert Enum.any?(files, &String.starts_with?(&1, bundled))
  end

  test "a mix release runs after it is moved and its sources and build are gone", ctx do
    dir = Path.join(ctx.tmp, "release")
    library = library_copy!(dir, ctx.checksums)
    # The application's config, rather than the environment, names the artifacts.
    config = "config :emlx_axon, precompiled: #{inspect(ctx.artifacts)}"
    app = tiny_app!(dir, library, Enum.join([config | backend_config(ctx)], "\n"))
    env = [{"MIX_ENV", "prod"}, {"EMLX_AXON_PRECOMPILED", nil} | clean_mix_env()]

    {output, status} =
      System.cmd("mix", ["release", "--quiet"], cd: app, env: env, stderr_to_stdout: true)

    assert status == 0, output

    moved = Path.join([dir, "elsewhere", "tiny"])
    File.mkdir_p!(Path.dirname(moved))
    File.rename!(Path.join(app, "_build/prod/rel/tiny"), moved)
    File.rm_rf!(app)
    File.rm_rf!(library)
    refute File.exists?(app) or File.exists?(library)

    # The NIF and libmlx are inside the release and found relative to it.
    [nif] = Path.wildcard(Path.join(moved, "lib/emlx_axon-*/priv/native/libemlx_axon_nif.so"))
    {dynamic, 0} = System.cmd("readelf", ["-d", nif])
    assert dynamic =~ "Library runpath: [$ORIGIN/mlx/lib]"

    {output, status} = eval(moved, generate_script(ctx), [{"LD_LIBRARY_PATH", ctx.library_path}])
    assert status == 0, output
    assert tokens(output) == ctx.greedy
    assert output =~ "BACKEND #{ctx.backend}"

    # Every MLX library the VM mapped came from the moved release.
    [_, maps] = Regex.run(~r/MAPS (.*)\n/, output)
    mapped = String.split(maps, ",", trim: true)
    assert Enum.any?(mapped, &String.ends_with?(&1, "/libmlx.so"))
    assert Enum.all?(mapped, &String.starts_with?(&1, moved <> "/")), maps

    # Asking for another backend than the release's at run time is a clear error.
    other = if ctx.backend == :cpu, do: :cuda, else: :cpu

    {output, status} =
      eval(moved, "EMLXAxon.mlx_info()", [
        {"EMLX_AXON_BACKEND", "#{other}"},
        {"LD_LIBRARY_PATH", ctx.library_path}
      ])

    assert status != 0

    assert output =~
             "built for the #{inspect(ctx.backend)} MLX backend, but EMLX_AXON_BACKEND asks for #{inspect(other)}"
  end

  test "a precompiled artifact over HTTP, with no cargo and no python", ctx do
    dir = Path.join(ctx.tmp, "precompiled")
    served = Path.join(dir, "served")
    File.mkdir_p!(served)
    name = Path.basename(ctx.tarball)
    good = File.read!(ctx.tarball)
    {port, stop} = serve!(served)
    on_exit(stop)

    library = library_copy!(dir, ctx.checksums)
    app = tiny_app!(dir, library, Enum.join(backend_config(ctx), "\n"))
    bin = path_without!(dir, ~w(cargo rustc rustup python python3 pip pip3))
    home = Path.join(dir, "home")
    File.mkdir_p!(home)

    {which, _} =
      System.cmd("sh", ["-c", "command -v cargo rustc python3 pip; true"], env: [{"PATH", bin}])

    assert which == ""

    env = fn source, extra ->
      [
        {"PATH", bin},
        {"HOME", home},
        {"MIX_ENV", "dev"},
        {"EMLX_AXON_PRECOMPILED", source},
        {"MLX_PREFIX", nil},
        {"VIRTUAL_ENV", nil},
        {"CARGO", nil},
        {"LD_LIBRARY_PATH", ctx.library_path}
        | clean_mix_env()
      ] ++ extra
    end

    url = "http://127.0.0.1:#{port}"
    mix = fn args, env -> System.cmd("mix", args, cd: app, env: env, stderr_to_stdout: true) end

    # No artifact for the target asked for: the checksum file does not list it.
    {output, status} =
      mix.(["compile"], env.(url, [{"EMLX_AXON_TARGET", "riscv64gc-unknown-linux-gnu"}]))

    assert status != 0
    assert output =~ "there is no precompiled emlx_axon"
    assert output =~ "riscv64gc-unknown-linux-gnu"
    assert output =~ name
    assert output =~ "build the native part from source"

    # Listed, but the server does not have it.
    {output, status} = mix.(["compile"], env.(url, []))
    assert status != 0
    assert output =~ "#{url}/#{name}: the server answered 404"

    # Nothing listens there.
    {closed, stop_closed} = serve!(served)
    stop_closed.()
    {output, status} = mix.(["compile"], env.("http://127.0.0.1:#{closed}", []))
    assert status != 0
    assert output =~ "could not download the precompiled emlx_axon artifact"
    assert output =~ "econnrefused"

    # A damaged download is refused and nothing is installed.
    File.write!(Path.join(served, name), binary_part(good, 0, byte_size(good) - 1024))
    {output, status} = mix.(["compile"], env.(url, []))
    assert status != 0
    assert output =~ "has sha256"
    assert output =~ "the download is damaged"
    refute File.exists?(Path.join(library, "priv/native/libemlx_axon_nif.so"))

    # The real one installs, and the application generates the reference tokens.
    File.write!(Path.join(served, name), good)
    {output, status} = mix.(["run", "-e", generate_script(ctx)], env.(url, []))
    assert status == 0, output
    assert output =~ "Installing the precompiled emlx_axon native part from #{url}/#{name}"
    refute output =~ "Compiling the emlx_axon NIF"
    assert tokens(output) == ctx.greedy

    # Installed once: the next compile neither downloads nor builds.
    {output, 0} = mix.(["compile"], env.(url, []))
    refute output =~ "Installing the precompiled"
  end

  ## Helpers

  defp generate_script(ctx) do
    """
    {:ok, _} = Application.ensure_all_started(:emlx_axon)
    state = EMLXAxon.Qwen3.Loader.load!(#{inspect(TestFixtures.path(@model))}, dtype: :float32)
    {:ok, %{token_ids: ids}} =
      EMLXAxon.Qwen3.Generate.generate(state, #{inspect(ctx.prompt)},
        max_new_tokens: #{length(ctx.greedy)}, ignore_eos: true)
    IO.puts("TOKENS " <> Enum.join(ids, ","))
    IO.puts("BACKEND \#{EMLXAxon.mlx_info().backend}")
    maps =
      File.read!("/proc/self/maps")
      |> String.split("\\n")
      |> Enum.map(&List.last(String.split(&1, " ")))
      |> Enum.filter(&String.contains?(&1, ["libmlx", "mlx_cpu.libs", "libemlx_axon_nif"]))
      |> Enum.uniq()
    IO.puts("MAPS " <> Enum.join(maps, ","))
    """
  end

  # The library path of a VM that runs the artifact: none of this run's own
  # (it may name another libmlx, which would then be loaded instead of the
  # artifact's), only the folders of the NVIDIA libraries that a CUDA build
  # takes from the system, where this VM found them. None for the CPU.
  defp system_library_path(libraries) do
    dirs =
      File.read!("/proc/self/maps")
      |> String.split("\n")
      |> Enum.map(&List.last(String.split(&1, " ")))
      |> Enum.filter(&(Path.basename(&1) in libraries))
      |> Enum.map(&Path.dirname/1)
      |> Enum.uniq()

    if dirs == [], do: nil, else: Enum.join(dirs, ":")
  end

  defp tokens(output) do
    [_, ids] = Regex.run(~r/TOKENS ([\d,]+)/, output)
    ids |> String.split(",") |> Enum.map(&String.to_integer/1)
  end

  defp eval(release, script, env) do
    System.cmd(Path.join(release, "bin/tiny"), ["eval", script],
      env: clean_mix_env() ++ env,
      stderr_to_stdout: true
    )
  end

  # Only what a Hex package of emlx_axon holds that the Elixir side needs:
  # no Rust sources, no target/, no .venv.
  defp library_copy!(dir, checksums) do
    library = Path.join(dir, "emlx_axon")
    File.mkdir_p!(Path.join(library, "native"))
    File.cp_r!(Path.join(@root, "lib"), Path.join(library, "lib"))
    File.cp!(Path.join(@root, "mix.exs"), Path.join(library, "mix.exs"))

    File.cp!(
      Path.join(@root, "native/mix_compiler.ex"),
      Path.join(library, "native/mix_compiler.ex")
    )

    File.cp_r!(Path.join(@root, "native/mix"), Path.join(library, "native/mix"))
    File.cp!(checksums, Path.join(library, "checksum-emlx_axon.exs"))
    library
  end

  # The application asks for the artifact's backend; the CPU, the default
  # on Linux, needs no setting.
  defp backend_config(%{backend: :cpu}), do: []

  defp backend_config(%{backend: backend}),
    do: ["config :emlx_axon, backend: #{inspect(backend)}"]

  defp tiny_app!(dir, library, config) do
    app = Path.join(dir, "tiny")
    File.mkdir_p!(Path.join(app, "lib"))

    if config != "" do
      File.mkdir_p!(Path.join(app, "config"))
      File.write!(Path.join(app, "config/config.exs"), "import Config\n#{config}\n")
    end

    File.write!(Path.join(app, "mix.exs"), """
    defmodule Tiny.MixProject do
      use Mix.Project

      def project do
        [
          app: :tiny,
          version: "0.1.0",
          elixir: "~> 1.14",
          deps: [{:emlx_axon, path: #{inspect(library)}}],
          releases: [tiny: [include_erts: true]]
        ]
      end

      def application, do: [extra_applications: [:logger]]
    end
    """)

    File.write!(Path.join(app, "lib/tiny.ex"), "defmodule Tiny do\nend\n")
    app
  end

  # The environment of a child `mix`, without this test run's own.
  defp clean_mix_env do
    for var <- ~w(MIX_BUILD_PATH MIX_BUILD_ROOT MIX_DEPS_PATH MIX_EXS MIX_LOCKFILE MIX_TARGET
                  CARGO_TARGET_DIR EMLX_AXON_SKIP_NATIVE EMLX_AXON_BACKEND EMLX_AXON_TARGET),
        do: {var, nil}
  end

  # A folder of links to everything on PATH except the named programs.
  defp path_without!(dir, hidden) do
    bin = Path.join(dir, "bin")
    File.mkdir_p!(bin)

    for path_dir <- System.get_env("PATH") |> String.split(":", trim: true),
        File.dir?(path_dir),
        name <- File.ls!(path_dir),
        name not in hidden,
        not File.exists?(Path.join(bin, name)) do
      File.ln_s(Path.join(path_dir, name), Path.join(bin, name))
    end

    bin
  end

  # A static file server on 127.0.0.1 only; returns its port and a stopper.
  defp serve!(root) do
    for app <- [:inets] do
      if function_exported?(Mix, :ensure_application!, 1),
        do: apply(Mix, :ensure_application!, [app])

      {:ok, _} = Application.ensure_all_started(app)
    end

    {:ok, pid} =
      :inets.start(:httpd,
        port: 0,
        bind_address: {127, 0, 0, 1},
        server_name: ~c"localhost",
        server_root: String.to_charlist(root),
        document_root: String.to_charlist(root),
        modules: [:mod_alias, :mod_get]
      )

    [port: port] = :httpd.info(pid, [:port])
    {port, fn -> :inets.stop(:httpd, pid) end}
  end
end
