# The NIF is built by the project's own Mix compiler. It must be loaded here,
# before the project is defined: a compiler under lib/ would only exist after
# lib/ is compiled, which is too late to build priv/ for that same compile.
Code.require_file("native/mix_compiler.ex", __DIR__)

defmodule EMLXAxon.MixProject do
  use Mix.Project

  @version "0.1.0"

  def project do
    [
      app: :emlx_axon,
      version: @version,
      elixir: "~> 1.14",
      start_permanent: Mix.env() == :prod,
      compilers: [:emlx_axon_native] ++ Mix.compilers(),
      elixirc_paths: elixirc_paths(Mix.env()),
      deps: deps(),
      description: "Qwen text generation for Elixir on Apple's MLX, through a Rust NIF",
      package: package(),
      docs: [main: "EMLXAxon", extras: ["notebooks/qwen3.livemd"]]
    ]
  end

  def application do
    [extra_applications: [:logger]]
  end

  defp elixirc_paths(:test), do: ["lib", "test/support"]
  defp elixirc_paths(_), do: ["lib"]

  # This repository builds and tests with no Hex packages at all. Nx (for
  # `EMLXAxon.TextGeneration.serving/3`) and :telemetry are optional: they are
  # declared only where Hex is installed, so applications that depend on
  # emlx_axon and bring them get them compiled before us. Set
  # EMLX_AXON_NO_HEX=1 to leave them out even where Hex is installed.
  defp deps do
    if hex_deps?() do
      [
        {:nx, "~> 0.9", optional: true},
        {:telemetry, "~> 1.0", optional: true}
      ]
    else
      []
    end
  end

  defp hex_deps? do
    System.get_env("EMLX_AXON_NO_HEX") in [nil, "", "0", "false"] and Code.ensure_loaded?(Hex)
  end

  defp package do
    [
      licenses: ["Apache-2.0"],
      files:
        ~w(lib native mix.exs .formatter.exs Cargo.toml Cargo.lock README* scripts checksum-emlx_axon.exs)
    ]
  end
end
