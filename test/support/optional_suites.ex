defmodule EMLXAxon.TestSuites do
  @moduledoc false
  # The test modules that run only where something optional is present,
  # and why, so that test_helper.exs can say which were left out.

  @doc "`[{module, file, reason}]` for every test module left out of this run."
  def left_out do
    [
      {"EMLXAxon.TextGeneration.ServingTest", "test/emlx_axon/serving_test.exs",
       Code.ensure_loaded?(Nx.Serving), "Nx is not available (add {:nx, \"~> 0.9\"})"},
      {"EMLXAxon.TextGeneration.ServingReliabilityTest",
       "test/emlx_axon/serving_reliability_test.exs", Code.ensure_loaded?(Nx.Serving),
       "Nx is not available (add {:nx, \"~> 0.9\"})"},
      {"EMLXAxon.HubServingTest", "test/emlx_axon/hub_serving_test.exs",
       Code.ensure_loaded?(Nx.Serving), "Nx is not available (add {:nx, \"~> 0.9\"})"},
      {"EMLXAxon.TelemetryTest", "test/emlx_axon/telemetry_test.exs",
       Code.ensure_loaded?(:telemetry), ":telemetry is not available"}
    ]
    |> Enum.reject(fn {_module, _file, available?, _reason} -> available? end)
    |> Enum.map(fn {module, file, _available?, reason} -> {module, file, reason} end)
  end

  @doc """
  `[{tag, reason}]` for every test tag whose tests need something this
  machine lacks: they are excluded, and test_helper.exs says why.
  """
  def excluded_tags do
    root = EMLXAxon.TestFixtures.root()

    [
      # scripts/setup's Python environment: the mlx wheel a source build
      # links (a machine given a built priv/native need not have it).
      {:setup_venv, Path.wildcard(Path.join(root, ".venv/lib/*/site-packages/mlx/lib")) != [],
       "the mlx wheel of scripts/setup's .venv is missing (run scripts/setup)"}
    ]
    |> Enum.reject(fn {_tag, available?, _reason} -> available? end)
    |> Enum.map(fn {tag, _available?, reason} -> {tag, reason} end)
  end
end
