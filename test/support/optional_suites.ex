defmodule EMLXAxon.TestSuites do
  @moduledoc false
  # The test modules that run only where something optional is present,
  # and why, so that test_helper.exs can say which were left out.

  @doc "`[{module, file, reason}]` for every test module left out of this run."
  def left_out do
    [
      {"EMLXAxon.TextGeneration.ServingTest", "test/emlx_axon/serving_test.exs",
       Code.ensure_loaded?(Nx.Serving), "Nx is not available (add {:nx, \"~> 0.9\"})"},
      {"EMLXAxon.TelemetryTest", "test/emlx_axon/telemetry_test.exs",
       Code.ensure_loaded?(:telemetry), ":telemetry is not available"}
    ]
    |> Enum.reject(fn {_module, _file, available?, _reason} -> available? end)
    |> Enum.map(fn {module, file, _available?, reason} -> {module, file, reason} end)
  end
end
