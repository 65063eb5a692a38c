defmodule EMLXAxon.MixProjectTest do
  use ExUnit.Case, async: false

  @root EMLXAxon.TestFixtures.root()

  @optional_deps [
    {:nx, "~> 0.9", optional: true},
    {:telemetry, "~> 1.0", optional: true},
    {:ex_doc, "~> 0.34", only: :dev, runtime: false, optional: true}
  ]

  test "Nx and telemetry are optional dependencies, declared only where Hex is" do
    hex? =
      Code.ensure_loaded?(Hex) and System.get_env("EMLX_AXON_NO_HEX") in [nil, "", "0", "false"]

    assert Mix.Project.config()[:deps] == if(hex?, do: @optional_deps, else: [])
    assert Mix.Project.config()[:compilers] == [:emlx_axon_native | Mix.compilers()]

    # The project's deps as a machine with Hex sees them (a stand-in Hex
    # module where Hex is missing), and with EMLX_AXON_NO_HEX=1.
    deps = fn env ->
      script = """
      unless Code.ensure_loaded?(Hex), do: defmodule(Hex, do: nil)
      Mix.start()
      Code.require_file("mix.exs")
      IO.write(inspect(EMLXAxon.MixProject.project()[:deps]))
      """

      {output, 0} = System.cmd("elixir", ["-e", script], cd: @root, env: env)
      output
    end

    assert deps.([{"EMLX_AXON_NO_HEX", nil}]) == inspect(@optional_deps)
    assert deps.([{"EMLX_AXON_NO_HEX", "1"}]) == "[]"
  end

  test "the NIF is installed in priv/native and reachable from the build" do
    assert File.regular?(Path.join(@root, "priv/native/libemlx_axon_nif.so"))
    assert File.regular?(Path.join(:code.priv_dir(:emlx_axon), "native/libemlx_axon_nif.so"))
  end

  test "priv/native is self-contained: libmlx beside the NIF, found through $ORIGIN" do
    native = Path.join(@root, "priv/native")
    nif = Path.join(native, "libemlx_axon_nif.so")

    {dynamic, 0} = System.cmd("readelf", ["-d", nif])
    paths = Regex.scan(~r/\((RUNPATH|RPATH)\)\s+Library r\w*path: \[(.*)\]/, dynamic)
    assert [[_, "RUNPATH", "$ORIGIN/mlx/lib"]] = paths

    # Every library the NIF loads from outside the system is under priv/native
    # (found without help: a library path set for this run is left out).
    {ldd, 0} = System.cmd("ldd", [nif], env: [{"LD_LIBRARY_PATH", nil}])
    refute ldd =~ "not found"
    assert ldd =~ "libmlx.so => #{native}/mlx/lib/libmlx.so"
    refute ldd =~ ".venv"

    # The backend of the wheel it was built with (the CPU's, or CUDA's on a
    # GPU machine) is the one the loaded libmlx reports.
    assert {:ok, %{backend: backend, target: target, version: version}} =
             EMLXAxon.NativeBuild.read(native)

    assert backend in [:cpu, :cuda]
    assert target =~ ~r/-linux-gnu$/
    assert version == Mix.Project.config()[:version]
    assert EMLXAxon.mlx_info().backend == backend
  end

  test "a second native compile is a no-op and does not run cargo" do
    Mix.Task.reenable("compile.emlx_axon_native")
    {time, result} = :timer.tc(fn -> Mix.Tasks.Compile.EmlxAxonNative.run([]) end)
    assert result == {:noop, []}
    assert time < 2_000_000
  end

  @tag :slow
  @tag timeout: 600_000
  test "mix compile works from scratch with no Hex, warning-free" do
    build = Path.join(System.tmp_dir!(), "emlx_axon_build_#{System.unique_integer([:positive])}")
    on_exit(fn -> File.rm_rf!(build) end)

    {output, status} =
      System.cmd("mix", ["compile", "--warnings-as-errors"],
        cd: @root,
        stderr_to_stdout: true,
        # Where Hex is installed, leave out the optional deps (not fetched here).
        env: [{"MIX_ENV", "dev"}, {"MIX_BUILD_PATH", build}, {"EMLX_AXON_NO_HEX", "1"}]
      )

    assert status == 0, output
    refute output =~ "warning"
    assert File.regular?(Path.join(build, "lib/emlx_axon/priv/native/libemlx_axon_nif.so"))
  end

  # The stand-in cargo reports the mlx-cpu wheel of scripts/setup's .venv.
  @tag :setup_venv
  @tag timeout: 600_000
  test "a fresh checkout: cargo runs, priv/ is created and reaches _build, failures explain the fix" do
    dir = Path.join(System.tmp_dir!(), "emlx_axon_fresh_#{System.unique_integer([:positive])}")
    on_exit(fn -> File.rm_rf!(dir) end)
    File.mkdir_p!(Path.join(dir, "native"))
    File.cp_r!(Path.join(@root, "lib"), Path.join(dir, "lib"))
    File.cp!(Path.join(@root, "mix.exs"), Path.join(dir, "mix.exs"))
    File.cp!(Path.join(@root, "native/mix_compiler.ex"), Path.join(dir, "native/mix_compiler.ex"))
    File.cp_r!(Path.join(@root, "native/mix"), Path.join(dir, "native/mix"))

    # A stand-in for cargo (the CARGO variable is honoured) that "builds" the
    # real library and reports the MLX it linked as cargo does, or fails
    # like cargo does.
    cargo = Path.join(dir, "fake-cargo")
    [mlx_lib] = Path.wildcard(Path.join(@root, ".venv/lib/*/site-packages/mlx/lib"))

    cargo_message =
      ~s({"reason":"build-script-executed","package_id":"path+file:///x/native/mlx-sys#0.7.0",) <>
        ~s("linked_paths":["native=/x/out/build","native=#{mlx_lib}"]})

    File.write!(cargo, """
    #!/bin/sh
    echo "fake cargo $*"
    if [ -n "$FAKE_CARGO_FAIL" ]; then echo "error: could not find MLX"; exit 101; fi
    mkdir -p target/release
    cp #{Path.join(@root, "priv/native/libemlx_axon_nif.so")} target/release/libemlx_axon_nif.so
    echo '#{cargo_message}'
    """)

    File.chmod!(cargo, 0o755)

    env = [
      {"CARGO", cargo},
      {"MIX_ENV", "dev"},
      {"MIX_BUILD_PATH", nil},
      {"CARGO_TARGET_DIR", nil},
      {"EMLX_AXON_SKIP_NATIVE", nil},
      # The copy has no deps fetched: where Hex is installed, leave them out.
      {"EMLX_AXON_NO_HEX", "1"}
    ]

    mix = fn args, extra_env ->
      System.cmd("mix", args, cd: dir, env: env ++ extra_env, stderr_to_stdout: true)
    end

    %{mlx_version: version} = EMLXAxon.mlx_info()
    {output, status} = mix.(["run", "-e", "IO.puts(EMLXAxon.mlx_info().mlx_version)"], [])
    assert status == 0, output
    assert output =~ "Compiling the emlx_axon NIF (cargo build --release -p emlx_axon_nif)"
    assert output =~ version
    refute output =~ "could not load"
    assert File.regular?(Path.join(dir, "priv/native/libemlx_axon_nif.so"))

    assert File.regular?(
             Path.join(dir, "_build/dev/lib/emlx_axon/priv/native/libemlx_axon_nif.so")
           )

    assert Path.wildcard(Path.join(dir, "priv/native/.*.tmp")) == []
    assert File.regular?(Path.join(dir, "priv/native/mlx/lib/libmlx.so"))

    # Nothing changed: cargo is not run again.
    {output, 0} = mix.(["compile"], [])
    refute output =~ "Compiling the emlx_axon NIF"

    # A failing build prints cargo's output and says how to fix it.
    {output, status} = mix.(["compile", "--force"], [{"FAKE_CARGO_FAIL", "1"}])
    assert status != 0
    assert output =~ "fake cargo build --release -p emlx_axon_nif"
    assert output =~ "error: could not find MLX"
    assert output =~ "could not build the emlx_axon NIF"
    assert output =~ "scripts/setup"

    # The backend asked for must be the one of the MLX wheel the build found.
    {output, status} = mix.(["compile"], [{"EMLX_AXON_BACKEND", "cuda"}])
    assert status != 0
    assert output =~ "the MLX backend :cuda was asked for"
    assert output =~ "is the mlx-cpu wheel (:cpu)"
    assert output =~ "MLX_BACKEND=cuda scripts/setup"
    refute File.exists?(Path.join(dir, "priv/native/mlx/include"))

    {output, status} = mix.(["compile"], [{"EMLX_AXON_BACKEND", "tpu"}])
    assert status != 0

    assert output =~
             ~s(EMLX_AXON_BACKEND is "tpu"; the MLX backend must be one of :cpu, :cuda, :metal)

    # Asked for explicitly, the wheel's backend builds (cargo without --features).
    {output, status} = mix.(["compile"], [{"EMLX_AXON_BACKEND", "cpu"}])
    assert status == 0, output
    assert output =~ "(cargo build --release -p emlx_axon_nif);"
  end
end
