defmodule EMLXAxon.PackageTest do
  # The package's `files` list (mix.exs) is exactly what a source build
  # needs: a folder holding only those files compiles, builds the NIF and
  # generates with it.
  use ExUnit.Case, async: false

  alias EMLXAxon.TestFixtures

  @root TestFixtures.root()
  @files Mix.Project.config()[:package][:files]
  # Written by `mix emlx_axon.precompile` when precompiled artifacts are
  # published; a source build does without it.
  @optional ["checksum-emlx_axon.exs"]

  # Every file a package entry stands for (a folder stands for all it holds).
  defp package_files do
    for entry <- @files, path = Path.join(@root, entry), File.exists?(path), reduce: [] do
      acc ->
        if File.dir?(path) do
          acc ++
            (Path.wildcard(Path.join(path, "**"), match_dot: true)
             |> Enum.filter(&File.regular?/1))
        else
          acc ++ [path]
        end
    end
    |> Enum.map(&Path.relative_to(&1, @root))
  end

  # A copy of exactly the package's files, with their modification times
  # (so that cargo, building the copy again in the same place, reuses what
  # it built before instead of rebuilding everything).
  defp copy_package!(dest) do
    File.rm_rf!(dest)

    for file <- package_files() do
      target = Path.join(dest, file)
      File.mkdir_p!(Path.dirname(target))
      File.cp!(Path.join(@root, file), target)
      %File.Stat{mtime: mtime, mode: mode} = File.stat!(Path.join(@root, file), time: :posix)
      File.chmod!(target, mode)
      File.touch!(target, mtime)
    end

    dest
  end

  defp clean_env do
    for var <- ~w(MIX_BUILD_PATH MIX_BUILD_ROOT MIX_DEPS_PATH MIX_EXS MIX_LOCKFILE MIX_TARGET
                  EMLX_AXON_SKIP_NATIVE EMLX_AXON_PRECOMPILED),
        do: {var, nil}
  end

  test "the files list: every entry exists, and no build trees, tests or local state" do
    for entry <- @files -- @optional do
      assert File.exists?(Path.join(@root, entry)), "#{entry} is listed but missing"
    end

    files = package_files()
    assert "mix.exs" in files and "LICENSE" in files and "CHANGELOG.md" in files
    assert "native/nif/src/lib.rs" in files and "native/mix_compiler.ex" in files

    for file <- files do
      refute file =~
               ~r{(^|/)(target|_build|deps|priv|\.venv|\.cache|test|tests|examples|benches)/},
             "#{file} does not belong in the package"
    end

    # Every crate of the Rust workspace is in the package.
    {:ok, cargo} = File.read(Path.join(@root, "Cargo.toml"))
    [_, members] = Regex.run(~r/members\s*=\s*\[([^\]]*)\]/, cargo)

    for [member] <- Regex.scan(~r/"([^"]+)"/, members, capture: :all_but_first) do
      assert Path.join(member, "Cargo.toml") in files
      assert Enum.any?(files, &String.starts_with?(&1, member <> "/src/")), member
    end
  end

  test "the Elixir code compiles from the package's files alone, warning-free" do
    dest = Path.join(System.tmp_dir!(), "emlx_axon_pkg_#{System.unique_integer([:positive])}")
    on_exit(fn -> File.rm_rf!(dest) end)
    copy_package!(dest)

    {output, status} =
      System.cmd("mix", ["compile", "--warnings-as-errors"],
        cd: dest,
        stderr_to_stdout: true,
        env:
          clean_env() ++
            [{"MIX_ENV", "dev"}, {"EMLX_AXON_SKIP_NATIVE", "1"}, {"EMLX_AXON_NO_HEX", "1"}]
      )

    assert status == 0, output
    # (The NIF, not built here, is said to be missing by a log line.)
    refute output =~ "warning: "

    # Cargo reads the workspace from the package: every member is there.
    cargo = System.find_executable("cargo") || Path.expand("~/.cargo/bin/cargo")

    {output, status} =
      System.cmd(cargo, ["metadata", "--format-version", "1", "--no-deps", "--offline"],
        cd: dest,
        stderr_to_stdout: true
      )

    assert status == 0, output

    for crate <- ~w(emlx_axon_nif emlx_axon_engine emlx_axon_kernels mlx-sys),
        do: assert(output =~ ~s("name":"#{crate}"))
  end

  # A full cargo build of the NIF from the copy (10+ minutes on 2 cores the
  # first time). It shares cargo's target folder with the project's own
  # build (EMLX_AXON_PACKAGE_TARGET_DIR, else CARGO_TARGET_DIR, else
  # target/), and the copy stays in one place inside it, so later runs are
  # incremental.
  @tag :package_build
  @tag :setup_venv
  @tag timeout: :infinity
  test "the NIF builds and loads from the package's files alone" do
    target_dir =
      Enum.find_value(["EMLX_AXON_PACKAGE_TARGET_DIR", "CARGO_TARGET_DIR"], fn var ->
        System.get_env(var) not in [nil, ""] && Path.expand(System.get_env(var), @root)
      end) || Path.join(@root, "target")

    dest = copy_package!(Path.join([target_dir, "package-check", "emlx_axon"]))
    [mlx] = Path.wildcard(Path.join(@root, ".venv/lib/*/site-packages/mlx"))

    # Building the copy puts its NIF where cargo leaves the project's own,
    # whose size and time the project's Mix compiler fingerprints: keep it.
    built = Path.join([target_dir, "release", "libemlx_axon_nif.so"])
    saved = Path.join(System.tmp_dir!(), "emlx_axon_nif_#{System.unique_integer([:positive])}")

    saved_mtime =
      case File.stat(built, time: :posix) do
        {:ok, %File.Stat{mtime: mtime}} ->
          File.cp!(built, saved)
          mtime

        {:error, _} ->
          nil
      end

    on_exit(fn ->
      if saved_mtime do
        File.cp!(saved, built)
        File.touch!(built, saved_mtime)
        File.rm(saved)
      end
    end)

    env =
      clean_env() ++
        [
          {"MIX_ENV", "prod"},
          {"CARGO_TARGET_DIR", target_dir},
          {"MLX_PREFIX", mlx},
          {"EMLX_AXON_NO_HEX", "1"}
        ]

    %{"prompt_ids" => prompt, "greedy_ids" => greedy} =
      TestFixtures.reference("qwen3-4bit-g64")["prompts"]["plain"]

    script = """
    state = EMLXAxon.Qwen3.Loader.load!(#{inspect(TestFixtures.path("qwen3-4bit-g64"))}, dtype: :float32)
    {:ok, %{token_ids: ids}} =
      EMLXAxon.Qwen3.Generate.generate(state, #{inspect(prompt)},
        max_new_tokens: #{length(greedy)}, ignore_eos: true)
    IO.puts("TOKENS " <> Enum.join(ids, ","))
    IO.puts("NIF " <> to_string(:code.priv_dir(:emlx_axon)))
    """

    {output, status} =
      System.cmd("mix", ["run", "-e", script], cd: dest, env: env, stderr_to_stdout: true)

    assert status == 0, output
    assert output =~ "TOKENS #{Enum.join(greedy, ",")}"
    assert File.regular?(Path.join(dest, "priv/native/libemlx_axon_nif.so"))
    assert output =~ "NIF #{dest}/_build/prod/lib/emlx_axon/priv"
  end
end
