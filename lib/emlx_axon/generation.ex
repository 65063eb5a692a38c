defmodule EMLXAxon.Generation do
  @moduledoc false
  # The decode loop shared by EMLXAxon.Qwen3.Generate, EMLXAxon.TextGeneration
  # and its Nx.Serving: one native generation for a whole batch of prompts,
  # decoded chunk by chunk (`generation_next/2`) so the caller can stream
  # text, enforce a timeout and stop early without holding a scheduler. The
  # generation (and its KV cache) is always freed before returning, also when
  # the chunk callback raises.

  alias EMLXAxon.{Error, Native, Options, Telemetry, Tokenizer}
  alias EMLXAxon.Qwen3.Model.State

  @type row :: %{
          ids: [non_neg_integer()],
          text: String.t(),
          finish_reason: :eos | :stop | :length | :max_len | :timeout | :cancelled
        }

  @type stats :: %{
          prompt_tokens: [non_neg_integer()],
          generated_tokens: [non_neg_integer()],
          forced_tokens: [non_neg_integer()],
          prefill_ms: float(),
          decode_ms: float(),
          decode_tokens_per_s: float(),
          time_to_first_token_ms: float(),
          total_ms: float(),
          decode_path: String.t() | nil,
          prefill_path: String.t() | nil,
          fallbacks: [String.t()] | nil,
          kv_dtype: EMLXAxon.Options.kv_dtype() | nil
        }

  @typedoc """
  Called after every native step with the rows' new ids and text (one map
  per prompt, in order: `%{ids: [...], text: binary, finish_reason: atom | nil}`).
  """
  @type on_chunk :: nil | ([map()] -> term())

  @doc """
  Validates `prompts`: a non-empty list of non-empty lists of token ids
  below the model's vocabulary size.
  """
  @spec validate_prompts!(term(), State.t()) :: [[non_neg_integer()]]
  def validate_prompts!([_ | _] = prompts, %State{config: config}) do
    vocab = config[:vocab_size]

    Enum.each(prompts, fn
      [_ | _] = ids ->
        Enum.each(ids, fn
          id when is_integer(id) and id >= 0 and (vocab == nil or id < vocab) ->
            :ok

          id ->
            raise ArgumentError,
                  "expected token ids to be integers from 0 to #{(vocab || 1) - 1}, got: #{inspect(id)}"
        end)

      [] ->
        raise ArgumentError, "cannot generate from an empty prompt: it has no tokens"

      other ->
        raise ArgumentError, "expected a prompt to be a list of token ids, got: #{inspect(other)}"
    end)

    prompts
  end

  def validate_prompts!(prompts, _state) do
    raise ArgumentError,
          "expected a non-empty list of prompts (lists of token ids), got: #{inspect(prompts)}"
  end

  @doc """
  Runs a generation of `prompts` (already validated) with `opts` (the
  validated options map: the native options plus `:timeout` and
  `:chunk_size`, and optionally `:gone_rows`, a function checked after
  every native step that returns the rows nobody reads any more: those end
  at once with `:cancelled`, and once every row is gone the rest end as on
  a timeout).
  Returns `{:ok, %{rows: [row], stats: stats}}`.
  """
  @spec run(
          State.t(),
          Tokenizer.t() | nil,
          reference() | nil,
          [[non_neg_integer()]],
          map(),
          on_chunk()
        ) ::
          {:ok, %{rows: [row()], stats: stats()}} | {:error, Error.t()}
  def run(%State{} = state, tokenizer, stream_ref, prompts, opts, on_chunk \\ nil) do
    metadata = %{
      batch_size: length(prompts),
      sampler: opts.sampler,
      max_new_tokens: opts.max_new_tokens
    }

    Telemetry.span([:emlx_axon, :generate], metadata, fn ->
      case do_run(state, tokenizer, stream_ref, prompts, opts, on_chunk) do
        {:ok, %{rows: rows, stats: stats}} = ok ->
          measurements = %{
            prompt_tokens: Enum.sum(stats.prompt_tokens),
            generated_tokens: Enum.sum(stats.generated_tokens),
            prefill_ms: stats.prefill_ms,
            decode_ms: stats.decode_ms,
            decode_tokens_per_s: stats.decode_tokens_per_s,
            time_to_first_token_ms: stats.time_to_first_token_ms
          }

          EMLXAxon.Notices.log_for(Map.get(stats, :fallbacks))

          stop_metadata =
            stats
            |> Map.take([:decode_path, :prefill_path, :fallbacks, :kv_dtype])
            |> Map.put(:finish_reasons, Enum.map(rows, & &1.finish_reason))

          {ok, measurements, stop_metadata}

        {:error, error} = result ->
          {result, %{}, %{error: error}}
      end
    end)
  end

  defp do_run(state, tokenizer, stream_ref, prompts, opts, on_chunk) do
    started = System.monotonic_time()
    tokenizer_ref = if tokenizer, do: tokenizer.ref
    native_opts = Options.native(opts)

    case Error.wrap(
           Native.generation_start(state.ref, tokenizer_ref, stream_ref, prompts, native_opts)
         ) do
      {:ok, generation} ->
        try do
          rows = Enum.map(prompts, fn _ -> {[], [], nil} end)
          deadline = deadline(opts.timeout, started)

          stop = %{deadline: deadline, gone_rows: Map.get(opts, :gone_rows), cancelled: []}

          # The first step is a single token, so a streaming caller sees the
          # first token as soon as it exists; then `chunk_size` at a time.
          with {:ok, rows} <- loop(generation, rows, 1, opts.chunk_size, stop, on_chunk),
               {:ok, stats} <- Error.wrap(Native.generation_stats(generation)) do
            total_ms =
              System.convert_time_unit(System.monotonic_time() - started, :native, :microsecond) /
                1000

            {:ok, %{rows: Enum.map(rows, &finish_row/1), stats: normalize_stats(stats, total_ms)}}
          end
        after
          Native.generation_free(generation)
        end

      # A schema, regex or grammar the engine refuses is the caller's
      # argument error, found before any generation work.
      {:error, %Error{kind: :invalid_constraint, message: message}} ->
        raise ArgumentError, message

      {:error, _} = error ->
        error
    end
  end

  defp loop(generation, rows, steps, chunk_size, stop, on_chunk) do
    case Error.wrap(Native.generation_next(generation, steps)) do
      {:ok, {status, chunk}} ->
        rows = Enum.zip_with(rows, chunk, &accumulate/2)
        if on_chunk, do: on_chunk.(chunk)
        gone = gone_rows(stop)

        cond do
          status == :done ->
            {:ok, rows}

          # Past the timeout, or nobody left to read the rows.
          past?(stop.deadline) or length(gone) == length(rows) ->
            {:ok, Enum.map(rows, &timeout_row/1)}

          true ->
            with {:ok, rows, stop} <- cancel(generation, rows, gone, stop) do
              loop(generation, rows, chunk_size, chunk_size, stop, on_chunk)
            end
        end

      {:error, _} = error ->
        error
    end
  end

  defp gone_rows(%{gone_rows: nil}), do: []
  defp gone_rows(%{gone_rows: gone_rows}), do: gone_rows.()

  # Rows whose readers left since the last step take no more tokens, and
  # end `:cancelled` unless they had ended already.
  defp cancel(generation, rows, gone, stop) do
    case gone -- stop.cancelled do
      [] ->
        {:ok, rows, stop}

      new ->
        with {:ok, :ok} <- Error.wrap(Native.generation_cancel_rows(generation, new)) do
          rows =
            rows
            |> Enum.with_index()
            |> Enum.map(fn
              {{ids, text, nil}, i} -> {ids, text, if(i in new, do: :cancelled)}
              {row, _i} -> row
            end)

          {:ok, rows, %{stop | cancelled: new ++ stop.cancelled}}
        end
    end
  end

  # Rows accumulate reversed lists of id chunks and text iodata.
  defp accumulate({ids, text, finish}, %{ids: new_ids, text: new_text} = chunk) do
    {[new_ids | ids], [text, new_text], finish || chunk[:finish_reason]}
  end

  defp timeout_row({ids, text, nil}), do: {ids, text, :timeout}
  defp timeout_row(row), do: row

  defp finish_row({ids, text, finish}) do
    %{
      ids: ids |> Enum.reverse() |> Enum.concat(),
      text: IO.iodata_to_binary(text),
      # The engine finishes every row before reporting :done.
      finish_reason: finish || :length
    }
  end

  defp deadline(:infinity, _started), do: nil

  defp deadline(timeout_ms, started),
    do: started + System.convert_time_unit(timeout_ms, :millisecond, :native)

  defp past?(nil), do: false
  defp past?(deadline), do: System.monotonic_time() >= deadline

  defp normalize_stats(stats, total_ms) do
    Map.merge(
      %{
        prompt_tokens: Map.get(stats, :prompt_tokens, []),
        generated_tokens: Map.get(stats, :generated_tokens, []),
        forced_tokens: Map.get(stats, :forced_tokens, []),
        prefill_ms: float(stats[:prefill_ms]),
        decode_ms: float(stats[:decode_ms]),
        decode_tokens_per_s: float(stats[:decode_tokens_per_s]),
        time_to_first_token_ms: float(stats[:time_to_first_token_ms]),
        total_ms: total_ms
      },
      EMLXAxon.Result.paths(stats)
    )
  end

  defp float(nil), do: 0.0
  defp float(value) when is_number(value), do: value / 1

  @doc """
  The metadata of row `index` of a finished generation (see
  `EMLXAxon.Result`), as a flat map.
  """
  @spec row_timings(stats(), non_neg_integer()) :: EMLXAxon.Result.metadata()
  def row_timings(stats, index) do
    %{
      prompt_tokens: Enum.at(stats.prompt_tokens, index, 0),
      generated_tokens: Enum.at(stats.generated_tokens, index, 0),
      forced_tokens: Enum.at(stats.forced_tokens, index, 0),
      batch_size: length(stats.prompt_tokens),
      prefill_ms: stats.prefill_ms,
      decode_ms: stats.decode_ms,
      decode_tokens_per_s: stats.decode_tokens_per_s,
      time_to_first_token_ms: stats.time_to_first_token_ms,
      total_ms: stats.total_ms,
      decode_path: stats.decode_path,
      prefill_path: stats.prefill_path,
      fallbacks: stats.fallbacks,
      kv_dtype: stats.kv_dtype
    }
  end
end
