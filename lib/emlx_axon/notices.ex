defmodule EMLXAxon.Notices do
  @moduledoc false
  # The engine keeps each notice once (a kernel check that failed, step
  # replays turned off for the process); a result whose fallbacks point at
  # them has them written to the log here, each once per VM, and emitted as
  # `[:emlx_axon, :notice]` telemetry.

  require Logger

  @seen {__MODULE__, :seen}

  @doc "Logs the engine's new notices when `fallbacks` refer to them."
  @spec log_for([String.t()] | nil) :: :ok
  def log_for(fallbacks) when is_list(fallbacks) do
    if Enum.any?(fallbacks, &(is_binary(&1) and String.contains?(&1, "see the notices"))),
      do: log_new()

    :ok
  end

  def log_for(_), do: :ok

  @doc "Logs the notices the engine has kept since the last call."
  @spec log_new() :: :ok
  def log_new do
    with %{notices: notices} when is_list(notices) <- EMLXAxon.mlx_info() do
      seen = :persistent_term.get(@seen, 0)

      case Enum.drop(notices, seen) do
        [] ->
          :ok

        new ->
          :persistent_term.put(@seen, length(notices))

          for message <- new do
            Logger.warning("emlx_axon: " <> message)
            EMLXAxon.Telemetry.execute([:emlx_axon, :notice], %{}, %{message: message})
          end
      end
    end

    :ok
  end
end
