# The NIF is built by the project's own Mix compiler. It must be loaded here,
# before the project is defined: a compiler under lib/ would only exist after
# lib/ is compiled, which is too late to build priv/ for that same compile.
Code.require_file("native/mix_compiler.ex", __DIR__)

defmodule EMLXAxon.MixProject do
  use Mix.Project

  @version "0.1.0"
  @source_url "https://github.com/emlx-axon/emlx_axon"

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
      source_url: @source_url,
      docs: docs()
    ]
  end

  def application do
    # :inets, :ssl, :public_key and :crypto download Hub checkpoints (EMLXAxon.Hub).
    [extra_applications: [:logger, :inets, :ssl, :public_key, :crypto]]
  end

  defp elixirc_paths(:test), do: ["lib", "test/support"]
  defp elixirc_paths(_), do: ["lib"]

  # This repository builds and tests with no Hex packages at all. Nx (for
  # `EMLXAxon.TextGeneration.serving/3`) and :telemetry are optional: they are
  # declared only where Hex is installed, so applications that depend on
  # emlx_axon and bring them get them compiled before us; so is ExDoc, for
  # `mix docs` in development. Set EMLX_AXON_NO_HEX=1 to leave them out even
  # where Hex is installed.
  defp deps do
    if hex_deps?() do
      [
        {:nx, "~> 0.9", optional: true},
        {:telemetry, "~> 1.0", optional: true},
        {:ex_doc, "~> 0.34", only: :dev, runtime: false, optional: true}
      ]
    else
      []
    end
  end

  defp hex_deps? do
    System.get_env("EMLX_AXON_NO_HEX") in [nil, "", "0", "false"] and Code.ensure_loaded?(Hex)
  end

  defp docs do
    [
      main: "readme",
      source_ref: "v#{@version}",
      extras: ["README.md", "CHANGELOG.md", "notebooks/qwen3.livemd", "LICENSE"],
      groups_for_modules: [
        Serving: [EMLXAxon.TextGeneration],
        Models: [
          EMLXAxon.Qwen3.Loader,
          EMLXAxon.Qwen3.Generate,
          EMLXAxon.Qwen3.Model,
          EMLXAxon.Qwen3.Model.State,
          EMLXAxon.Tokenizer,
          EMLXAxon.Hub
        ],
        Scheduler: [EMLXAxon.Scheduler],
        "Structured output": [EMLXAxon.ToolCalls, EMLXAxon.JSON, EMLXAxon.JSON.Decoder],
        Streams: [EMLXAxon.Stream],
        Native: [EMLXAxon, EMLXAxon.Error, EMLXAxon.Telemetry]
      ]
    ]
  end

  # Exactly what building from source needs (test/package_test.exs builds
  # the NIF from a copy of these alone): the Elixir code, the Mix compiler,
  # the Rust workspace's manifests and sources (no tests, examples, benches
  # or build trees) and scripts/setup, which installs MLX.
  @package_files ~w(
    lib mix.exs .formatter.exs README.md CHANGELOG.md LICENSE checksum-emlx_axon.exs
    native/mix_compiler.ex native/mix
    Cargo.toml Cargo.lock
    native/mlx-sys/Cargo.toml native/mlx-sys/build.rs native/mlx-sys/src native/mlx-sys/compat
    native/kernels/Cargo.toml native/kernels/build.rs native/kernels/src native/kernels/csrc
    native/engine/Cargo.toml native/engine/build.rs native/engine/src
    native/nif/Cargo.toml native/nif/build.rs native/nif/src
    scripts/setup
  )

  defp package do
    [
      licenses: ["Apache-2.0"],
      links: %{"GitHub" => @source_url, "Changelog" => "#{@source_url}/blob/main/CHANGELOG.md"},
      files: @package_files
    ]
  end
end
