defmodule EMLXAxon.MixProjectTest do
  use ExUnit.Case, async: false

  @root EMLXAxon.TestFixtures.root()

  test "the project declares no dependencies without Hex" do
    refute Code.ensure_loaded?(Hex)
    assert Mix.Project.config()[:deps] == []
    assert Mix.Project.config()[:compilers] == [:emlx_axon_native | Mix.compilers()]
  end

  test "the NIF is installed in priv/native and reachable from the build" do
    assert File.regular?(Path.join(@root, "priv/native/libemlx_axon_nif.so"))
    assert File.regular?(Path.join(:code.priv_dir(:emlx_axon), "native/libemlx_axon_nif.so"))
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
        env: [{"MIX_ENV", "dev"}, {"MIX_BUILD_PATH", build}, {"EMLX_AXON_NO_HEX", nil}]
      )

    assert status == 0, output
    refute output =~ "warning"
    assert File.regular?(Path.join(build, "lib/emlx_axon/priv/native/libemlx_axon_nif.so"))
  end
end
