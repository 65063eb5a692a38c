defmodule EMLXAxon.Telemetry do
  @moduledoc """
  Telemetry events emitted by emlx_axon.

  `:telemetry` is an optional dependency: the events below are emitted when
  it is loaded, and cost nothing otherwise. They follow `:telemetry.span/3`'s
  conventions.

    * `[:emlx_axon, :load, :start | :stop | :exception]` - loading a model
      (`EMLXAxon.Qwen3.Loader.load/2`). Metadata: `%{path: path}`, plus
      `%{model_type: ..., quantization: ..., dtype: ...}` on `:stop`.
      The `:stop` measurements add `:weight_bytes` and `:load_ms`.

    * `[:emlx_axon, :generate, :start | :stop | :exception]` - one batched
      generation (`EMLXAxon.Qwen3.Generate`, `EMLXAxon.TextGeneration`).
      Metadata: `%{batch_size: n, sampler: atom, max_new_tokens: n}`, plus
      `%{finish_reasons: [atom]}` on `:stop`. The `:stop` measurements add
      `:prompt_tokens` and `:generated_tokens` (summed over the batch),
      `:prefill_ms`, `:decode_ms`, `:decode_tokens_per_s` and
      `:time_to_first_token_ms` (zeros unless `profile_timing: true`).

    * `[:emlx_axon, :hub, :fetch, :start | :stop | :exception]` - fetching
      a Hugging Face Hub repository (`EMLXAxon.Hub`). Metadata:
      `%{repo: repo, revision: revision}`, plus `%{path: dir}` or
      `%{error: error}` on `:stop`.

    * `[:emlx_axon, :hub, :download, :start | :stop | :exception]` - one
      file downloaded into the cache (not emitted for files already there).
      Metadata: `%{repo: repo, revision: revision, file: file, size: bytes}`
      (`size` may be `nil`). The `:stop` measurements add `:bytes`, the
      bytes transferred.

    * `[:emlx_axon, :hub, :download, :progress]` - while a file downloads,
      at most every 250 ms and at its end. Measurements: `%{bytes: done,
      total: size}` (`total` may be `nil`); metadata: `%{repo: repo,
      revision: revision, file: file}`.

  As with `:telemetry.span/3`, `:start` carries `:system_time` and
  `:monotonic_time`, `:stop` and `:exception` carry `:duration` (native time
  units), and all three share a `:telemetry_span_context`.
  """

  @doc false
  # Runs `fun`, which returns `{result, extra_measurements, stop_metadata}`,
  # inside a span. Emits nothing when :telemetry is not loaded.
  @spec span([atom()], map(), (() -> {term(), map(), map()})) :: term()
  def span(event, metadata, fun) do
    if enabled?() do
      do_span(event, metadata, fun)
    else
      {result, _measurements, _metadata} = fun.()
      result
    end
  end

  defp do_span(event, metadata, fun) do
    start = System.monotonic_time()
    metadata = Map.put(metadata, :telemetry_span_context, make_ref())

    emit(
      event ++ [:start],
      %{system_time: System.system_time(), monotonic_time: start},
      metadata
    )

    try do
      fun.()
    catch
      kind, reason ->
        stop = System.monotonic_time()

        emit(
          event ++ [:exception],
          %{duration: stop - start, monotonic_time: stop},
          Map.merge(metadata, %{kind: kind, reason: reason, stacktrace: __STACKTRACE__})
        )

        :erlang.raise(kind, reason, __STACKTRACE__)
    else
      {result, measurements, stop_metadata} ->
        stop = System.monotonic_time()

        emit(
          event ++ [:stop],
          Map.merge(measurements, %{duration: stop - start, monotonic_time: stop}),
          Map.merge(metadata, stop_metadata)
        )

        result
    end
  end

  @doc false
  # Emits one event, when :telemetry is loaded.
  @spec execute([atom()], map(), map()) :: :ok
  def execute(event, measurements, metadata) do
    if enabled?(), do: emit(event, measurements, metadata)
    :ok
  end

  # :telemetry is optional: call it dynamically so this compiles without it.
  defp emit(event, measurements, metadata) do
    apply(:telemetry, :execute, [event, measurements, metadata])
  end

  defp enabled? do
    case :persistent_term.get({__MODULE__, :enabled}, :unknown) do
      :unknown ->
        enabled = Code.ensure_loaded?(:telemetry) and function_exported?(:telemetry, :execute, 3)
        # Cache only a positive answer: :telemetry may be loaded later.
        if enabled, do: :persistent_term.put({__MODULE__, :enabled}, true)
        enabled

      enabled ->
        enabled
    end
  end
end
