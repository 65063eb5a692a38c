defmodule EMLXAxon.Telemetry do
  @moduledoc """
  Telemetry events emitted by emlx_axon.

  `:telemetry` is an optional dependency: the events below are emitted when
  it is loaded, and cost nothing otherwise. Durations are in native time
  units (`System.monotonic_time/0` differences; convert them with
  `System.convert_time_unit/3`), as in `:telemetry.span/3`.

  | Event | Measurements | Metadata |
  | --- | --- | --- |
  | `[:emlx_axon, :load, :start]` | `:system_time`, `:monotonic_time` | `:path` |
  | `[:emlx_axon, :load, :stop]` | `:duration`, `:monotonic_time`, `:weight_bytes`, `:load_ms` | `:path`, and `:model_type`, `:quantization`, `:dtype` (or `:error`) |
  | `[:emlx_axon, :load, :exception]` | `:duration`, `:monotonic_time` | `:path`, `:kind`, `:reason`, `:stacktrace` |
  | `[:emlx_axon, :generate, :start]` | `:system_time`, `:monotonic_time` | `:batch_size`, `:sampler`, `:max_new_tokens` |
  | `[:emlx_axon, :generate, :stop]` | `:duration`, `:monotonic_time`, `:prompt_tokens`, `:generated_tokens`, `:prefill_ms`, `:decode_ms`, `:decode_tokens_per_s`, `:time_to_first_token_ms` | `:start`'s, and `:finish_reasons`, `:decode_path`, `:prefill_path`, `:fallbacks`, `:kv_dtype` (or `:error`) |
  | `[:emlx_axon, :generate, :exception]` | `:duration`, `:monotonic_time` | `:start`'s, and `:kind`, `:reason`, `:stacktrace` |
  | `[:emlx_axon, :scheduler, :step]` | `:duration`, `:running`, `:waiting`, `:slots`, `:tokens` | `%{}` |
  | `[:emlx_axon, :notice]` | `%{}` | `:message`: a notice of the engine (a kernel check that failed, step replays turned off), once per VM, also written to the log |
  | `[:emlx_axon, :scheduler, :request]` | `:prompt_tokens`, `:cached_tokens`, `:generated_tokens`, `:queue_ms`, `:prefill_ms`, `:time_to_first_token_ms`, `:decode_tokens_per_s`, `:constraint_ms` | `:finish_reason`, `:decode_path`, `:prefill_path`, `:fallbacks`, `:kv_dtype` |

    * `:load` - loading a model (`EMLXAxon.Qwen3.Loader.load/2`), a span.
      `:load_ms` is the engine's own measure; `:quantization` is the
      checkpoint's.
    * `:generate` - one batched generation (`EMLXAxon.Qwen3.Generate`,
      `EMLXAxon.TextGeneration` and its serving, without a scheduler), a
      span. Token counts are summed over the batch; the `_ms` timings are
      zeros unless `profile_timing: true`. `:finish_reasons` has one per
      row. A generation that fails with an `EMLXAxon.Error` ends with
      `:stop` and `:error` in its metadata.
    * `:scheduler, :step` - after every step of an `EMLXAxon.Scheduler`
      that produced tokens (a decode step, or a prompt chunk that gave a
      first token): its `:duration` (since the previous one, while
      requests ran), the rows `:running` and `:waiting`, the scheduler's
      `:slots` and the `:tokens` the step produced.
    * `:scheduler, :request` - when a scheduler's request ends (not when it
      is cancelled): its stats, as in its `:done` message (empty when it
      timed out).

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

  `:decode_path` and `:prefill_path` name the engine path that decoded
  and prefilled (such as `"cuda_replay"`, `"cuda_layers"`, `"cpu_layers"`
  or `"mlx"`), `:fallbacks` lists why a faster path was not taken and
  `:kv_dtype` is the KV cache's dtype, as in a result's metadata (see
  `EMLXAxon.Result`); each is `nil` where the engine does not report it.

  The spans' three events share a `:telemetry_span_context`.
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

  @doc false
  # Emits one event; `fun` returns `{measurements, metadata}` and runs
  # only when :telemetry is loaded.
  @spec execute([atom()], (() -> {map(), map()})) :: :ok
  def execute(event, fun) do
    if enabled?() do
      {measurements, metadata} = fun.()
      emit(event, measurements, metadata)
    end

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
