# The optional :telemetry package, where it is not installed (this project
# builds and tests without Hex packages): just enough of its API
# (attach/4, attach_many/4, detach/1, execute/3), so the events
# EMLXAxon.Telemetry emits are tested on every machine. Where the real
# package is present, it is used instead.
unless Code.ensure_loaded?(:telemetry) do
  defmodule :telemetry do
    @moduledoc false

    @key {__MODULE__, :handlers}

    def attach(id, event, fun, config), do: attach_many(id, [event], fun, config)

    def attach_many(id, events, fun, config) when is_function(fun, 4) do
      :global.trans({__MODULE__, self()}, fn ->
        handlers = :persistent_term.get(@key, %{})

        if Map.has_key?(handlers, id) do
          {:error, :already_exists}
        else
          :persistent_term.put(@key, Map.put(handlers, id, {events, fun, config}))
          :ok
        end
      end)
    end

    def detach(id) do
      :global.trans({__MODULE__, self()}, fn ->
        handlers = :persistent_term.get(@key, %{})

        if Map.has_key?(handlers, id) do
          :persistent_term.put(@key, Map.delete(handlers, id))
          :ok
        else
          {:error, :not_found}
        end
      end)
    end

    def execute(event, measurements, metadata) when is_map(measurements) and is_map(metadata) do
      for {_id, {events, fun, config}} <- :persistent_term.get(@key, %{}), event in events do
        fun.(event, measurements, metadata, config)
      end

      :ok
    end
  end
end
