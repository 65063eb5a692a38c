defmodule EMLXAxon.TestCallers do
  @moduledoc false
  # Callers under failure tests: each in a task that reports what it got,
  # and a bounded wait for a condition.

  import ExUnit.Assertions, only: [flunk: 1]

  @doc "Runs `fun` in a task that answers `{:returned, value}` or `{:raised, error}`."
  def caller(fun) do
    Task.async(fn ->
      try do
        {:returned, fun.()}
      rescue
        error -> {:raised, error}
      end
    end)
  end

  @doc "Waits until `fun` returns true, failing the test after `ms` milliseconds."
  def wait_until(fun, ms \\ 30_000) do
    deadline = System.monotonic_time(:millisecond) + ms

    Enum.find_value(Stream.repeatedly(fn -> :tick end), fn _ ->
      cond do
        fun.() -> true
        System.monotonic_time(:millisecond) > deadline -> flunk("timed out waiting")
        true -> Process.sleep(5) && nil
      end
    end)
  end
end
