# The Elixir peer of the benchmarks: the engine through the NIF, as an
# application uses it. Same measurements, checkpoint and prompt ids as the
# engine's `bench` example and bench/mlx_lm_bench.py; one JSON object per
# measurement on stdout.
#
#   mix run bench/elixir_bench.exs --model DIR --prompts FILE.json
#       [--dtype float32|bfloat16|float16] [--tokens N] [--batch-tokens N]
#       [--batch 1,4,8] [--measures decode,prefill,batch,textgen]
#       [--warmup K] [--warmup-mode full|light] [--runs R] [--chunk C]
#       [--label elixir]
#
# The prompt ids are read from FILE.exs next to FILE.json (bench/prompts.py
# writes both; this project has no JSON library).
#
#   decode, prefill, batch   EMLXAxon.Qwen3.Loader.load/2 +
#                            EMLXAxon.Qwen3.Generate.generate/3 with the ids
#   textgen                  EMLXAxon.TextGeneration.stream/5 (run/4's path
#                            plus a callback) with %{input_ids: ids} (batch 1;
#                            detokenizes too); its rows say peer
#                            "<label>-textgen"
#
# Every call passes ignore_eos: true and profile_timing: true. Times are taken
# on this process's clock, as the other peers take theirs: the time to first
# token runs from the call to the first chunk of ids (Generate's :on_chunk) or
# text (stream/5) reaching the caller, decode speed is (tokens - 1) / (last
# chunk - first chunk), and the decode measure's ids are reported so that
# bench/report.py can check every peer generated the same greedy ids. The
# engine's own clock is kept apart (engine_ttft_ms, engine_decode_ms);
# overhead_ms is what the call took beyond its first-to-last-chunk span and
# time to first token (result building, freeing). Peak RSS is the BEAM's
# VmHWM, reset through /proc/self/clear_refs before each measure, after
# freeing MLX's buffer cache
# and resetting its peak (EMLXAxon.clear_memory_cache/0 and
# reset_peak_memory/0, where the library has them).

defmodule EMLXAxon.Bench do
  alias EMLXAxon.Qwen3.{Generate, Loader}

  @switches [
    model: :string,
    prompts: :string,
    dtype: :string,
    tokens: :integer,
    batch_tokens: :integer,
    batch: :string,
    measures: :string,
    warmup: :integer,
    warmup_mode: :string,
    runs: :integer,
    chunk: :integer,
    label: :string
  ]

  def main(argv) do
    {opts, rest, invalid} = OptionParser.parse(argv, strict: @switches)

    if rest != [] or invalid != [] do
      fail("unknown arguments: #{inspect(rest ++ invalid)}")
    end

    model = opts[:model] || fail("--model DIR is required")
    prompts_file = opts[:prompts] || fail("--prompts FILE is required")
    {prompts, _} = Code.eval_file(Path.rootname(prompts_file) <> ".exs")
    tokens = opts[:tokens] || 128

    cfg = %{
      model: model,
      prompts: prompts,
      dtype: opts[:dtype] && String.to_atom(opts[:dtype]),
      tokens: tokens,
      batch_tokens: opts[:batch_tokens] || tokens,
      batches: parse_ints(opts[:batch] || "1,4,8"),
      measures: String.split(opts[:measures] || "decode,prefill,batch", ","),
      warmup: opts[:warmup] || 1,
      light_warmup: opts[:warmup_mode] == "light",
      runs: opts[:runs] || 1,
      chunk: opts[:chunk] || 16,
      label: opts[:label] || "elixir"
    }

    if cfg.tokens < 2 or cfg.batch_tokens < 2, do: fail("--tokens must be at least 2")

    case EMLXAxon.Native.load_error() do
      nil -> :ok
      message -> fail("NIF not loaded: " <> message)
    end

    run(cfg)
  end

  defp run(cfg) do
    load_opts = if cfg.dtype, do: [dtype: cfg.dtype], else: []
    # The tokenizer (for TextGeneration.run) first, so the model's load is
    # measured on its own; its memory is reported apart.
    before_tokenizer = memory().rss_mb
    {:ok, tokenizer} = EMLXAxon.Tokenizer.load(cfg.model)
    :erlang.garbage_collect()
    baseline = memory().rss_mb
    {load_us, {:ok, state}} = :timer.tc(fn -> Loader.load(cfg.model, load_opts) end)
    info = EMLXAxon.mlx_info()
    device = to_string(info.default_device)

    common = %{
      peer: cfg.label,
      model: Path.basename(cfg.model),
      dtype: to_string(state.config[:dtype] || cfg.dtype || "default"),
      device: device
    }

    cfg = Map.merge(cfg, %{state: state, tokenizer: tokenizer, common: common})

    emit(
      cfg,
      "load",
      nil,
      %{
        load_ms: Float.round(load_us / 1000, 1),
        engine_load_ms: Float.round(state.config[:load_ms] / 1, 1),
        rss_before_load_mb: baseline,
        tokenizer_rss_mb: Float.round(baseline - before_tokenizer, 1),
        weight_bytes: state.config[:weight_bytes],
        mlx_version: info.mlx_version,
        prompts_sha256: cfg.prompts.sha256,
        elixir: System.version(),
        otp: System.otp_release()
      }
      |> Map.merge(memory())
    )

    warm_up(cfg)

    for run <- 0..(cfg.runs - 1) do
      if wants?(cfg, "decode"), do: decode(cfg, run)
      if wants?(cfg, "textgen"), do: textgen(cfg, run)
      if wants?(cfg, "prefill"), do: prefill(cfg, run)

      if wants?(cfg, "batch") do
        for b <- cfg.batches, do: batch(cfg, run, b)
      end
    end

    :ok
  end

  defp wants?(cfg, measure), do: measure in cfg.measures

  defp gen_opts(cfg, tokens, longest) do
    [
      max_new_tokens: tokens,
      max_len: longest + tokens + 1,
      ignore_eos: true,
      profile_timing: true,
      chunk_size: cfg.chunk
    ]
  end

  # One timed call of Generate.generate/3 on `prompts` (a list of id lists),
  # on the caller's clock as the other peers time theirs: the time to first
  # token runs from the call to the first chunk of ids reaching this
  # process, and decode from that chunk to the last. The engine's own clock
  # is kept apart (engine_*).
  defp generate(cfg, prompts, tokens) do
    longest = prompts |> Enum.map(&length/1) |> Enum.max()
    input = if length(prompts) == 1, do: hd(prompts), else: prompts
    # on_chunk runs in this process, between the native calls.
    stamp = fn _rows ->
      now = System.monotonic_time()
      if Process.get(:bench_first) == nil, do: Process.put(:bench_first, now)
      Process.put(:bench_last, now)
    end

    Process.delete(:bench_first)
    opts = [on_chunk: stamp] ++ gen_opts(cfg, tokens, longest)
    started = System.monotonic_time()
    {:ok, result} = Generate.generate(cfg.state, input, opts)
    finished = System.monotonic_time()
    {first, last} = {Process.get(:bench_first), Process.get(:bench_last)}

    results = List.wrap(result)
    counts = Enum.map(results, &length(&1.token_ids))

    if Enum.any?(counts, &(&1 != tokens)) do
      fail("expected #{tokens} tokens per row, got #{inspect(counts)}")
    end

    ms = &(System.convert_time_unit(&1, :native, :microsecond) / 1000)

    timed = %{
      ttft_ms: ms.(first - started),
      decode_ms: ms.(last - first),
      wall_ms: ms.(finished - started),
      engine: hd(results).timings,
      ids: hd(results).token_ids
    }

    {timed, Enum.sum(counts)}
  end

  defp batch_prompts(cfg, b) do
    rows = cfg.prompts.batch
    for i <- 0..(b - 1), do: Enum.at(rows, rem(i, length(rows)))
  end

  # Full: every measure once, shortened. Light (for slow CPUs): a 2-token
  # prompt decoding 2 tokens, then the largest batch likewise.
  defp warm_up(cfg) do
    largest = Enum.max(cfg.batches, fn -> 1 end)
    short = &Enum.take(&1, 2)

    {us, _} =
      :timer.tc(fn ->
        for _ <- List.duplicate(:warmup, cfg.warmup) do
          if cfg.light_warmup do
            generate(cfg, [short.(cfg.prompts.decode)], 2)

            if wants?(cfg, "batch") and largest > 1,
              do: generate(cfg, Enum.map(batch_prompts(cfg, largest), short), 2)
          else
            if wants?(cfg, "decode") or wants?(cfg, "textgen"),
              do: generate(cfg, [cfg.prompts.decode], 4)

            if wants?(cfg, "prefill"), do: generate(cfg, [cfg.prompts.prefill], 2)

            if wants?(cfg, "batch") do
              for b <- cfg.batches, do: generate(cfg, batch_prompts(cfg, b), 2)
            end
          end
        end
      end)

    emit(cfg, "warmup", nil, %{
      iterations: cfg.warmup,
      mode: if(cfg.light_warmup, do: "light", else: "full"),
      wall_ms: Float.round(us / 1000, 1)
    })
  end

  defp decode(cfg, run) do
    n = cfg.tokens
    prompt = cfg.prompts.decode
    reset_memory()
    {t, _} = generate(cfg, [prompt], n)

    emit(
      cfg,
      "decode",
      run,
      timing_fields(t, 1, n) |> Map.merge(%{prompt_tokens: length(prompt), ids: t.ids})
    )
  end

  # TextGeneration.run/4's path, timed on the caller's clock through
  # stream/5 (run/4 plus the callback): first and last text pieces. A first
  # token with no text of its own (part of a UTF-8 character) would be timed
  # at the next piece: that errs towards slower, never faster.
  defp textgen(cfg, run) do
    n = cfg.tokens
    prompt = cfg.prompts.decode
    reset_memory()
    Process.delete(:bench_first)

    stamp = fn _text ->
      now = System.monotonic_time()
      if Process.get(:bench_first) == nil, do: Process.put(:bench_first, now)
      Process.put(:bench_last, now)
    end

    started = System.monotonic_time()

    output =
      EMLXAxon.TextGeneration.stream(
        cfg.tokenizer,
        cfg.state,
        %{input_ids: prompt},
        stamp,
        gen_opts(cfg, n, length(prompt))
      )

    finished = System.monotonic_time()
    [%{num_tokens: ^n, token_ids: ids}] = output.results
    ms = &(System.convert_time_unit(&1, :native, :microsecond) / 1000)
    {first, last} = {Process.get(:bench_first), Process.get(:bench_last)}

    t = %{
      ttft_ms: ms.(first - started),
      decode_ms: ms.(last - first),
      wall_ms: ms.(finished - started),
      engine: output.metadata,
      ids: ids
    }

    emit(
      put_in(cfg.common.peer, cfg.label <> "-textgen"),
      "decode",
      run,
      timing_fields(t, 1, n)
      |> Map.merge(%{prompt_tokens: length(prompt), path: "TextGeneration.stream", ids: ids})
    )
  end

  defp prefill(cfg, run) do
    prompt = cfg.prompts.prefill
    reset_memory()
    {t, _} = generate(cfg, [prompt], 2)

    emit(
      cfg,
      "prefill",
      run,
      %{
        batch: 1,
        prompt_tokens: length(prompt),
        tok_s: Float.round(length(prompt) / (t.ttft_ms / 1000), 3),
        ttft_ms: Float.round(t.ttft_ms, 2),
        engine_ttft_ms: Float.round(t.engine.time_to_first_token_ms / 1, 2),
        engine_prefill_ms: Float.round(t.engine.prefill_ms / 1, 2),
        wall_ms: Float.round(t.wall_ms, 2)
      }
      |> Map.merge(memory())
    )
  end

  defp batch(cfg, run, b) do
    n = cfg.batch_tokens
    prompts = batch_prompts(cfg, b)
    reset_memory()
    {t, generated} = generate(cfg, prompts, n)

    emit(
      cfg,
      "batch",
      run,
      timing_fields(t, b, n)
      |> Map.merge(%{prompt_tokens: length(hd(prompts)), generated: generated})
    )
  end

  # Speeds on the caller's clock (as every peer measures); the engine's own
  # clock is kept as engine_* to show where the time goes.
  defp timing_fields(t, b, n) do
    %{
      batch: b,
      tokens: n,
      tok_s: Float.round(b * (n - 1) / (t.decode_ms / 1000), 3),
      ttft_ms: Float.round(t.ttft_ms, 2),
      decode_ms: Float.round(t.decode_ms, 2),
      wall_ms: Float.round(t.wall_ms, 2),
      engine_ttft_ms: Float.round(t.engine.time_to_first_token_ms / 1, 2),
      engine_decode_ms: Float.round(t.engine.decode_ms / 1, 2),
      overhead_ms: Float.round(t.wall_ms - t.ttft_ms - t.decode_ms, 2),
      engine_decode_tok_s: Float.round(t.engine.decode_tokens_per_s / 1, 3)
    }
    |> Map.merge(memory())
  end

  # EMLXAxon's memory functions where this version of the library has them.
  defp mlx_memory?(name) do
    Code.ensure_loaded?(EMLXAxon) and function_exported?(EMLXAxon, name, 0)
  end

  defp reset_memory do
    :erlang.garbage_collect()

    if mlx_memory?(:clear_memory_cache) do
      EMLXAxon.clear_memory_cache()
      EMLXAxon.reset_peak_memory()
    end

    _ = File.write("/proc/self/clear_refs", "5")
    :ok
  end

  defp memory do
    status =
      case File.read("/proc/self/status") do
        {:ok, text} -> text
        _ -> ""
      end

    kb = fn key ->
      case Regex.run(~r/^#{key}:\s+(\d+) kB/m, status) do
        [_, v] -> Float.round(String.to_integer(v) / 1024, 1)
        _ -> nil
      end
    end

    mlx_peak =
      if mlx_memory?(:memory_info),
        do: Float.round(EMLXAxon.memory_info().peak / 1_048_576, 1),
        else: nil

    %{peak_rss_mb: kb.("VmHWM"), rss_mb: kb.("VmRSS"), mlx_peak_mb: mlx_peak}
  end

  defp emit(cfg, measure, run, fields) do
    out = cfg.common |> Map.put(:measure, measure) |> Map.merge(fields)
    out = if run, do: Map.put(out, :run, run), else: out
    IO.puts(json(out))
  end

  defp parse_ints(s), do: s |> String.split(",", trim: true) |> Enum.map(&String.to_integer/1)

  defp fail(message) do
    IO.puts(:stderr, "error: " <> message)
    System.halt(2)
  end

  # A minimal JSON encoder for the flat maps above.
  defp json(nil), do: "null"
  defp json(true), do: "true"
  defp json(false), do: "false"
  defp json(v) when is_atom(v), do: json(Atom.to_string(v))
  defp json(v) when is_integer(v), do: Integer.to_string(v)
  defp json(v) when is_float(v), do: Float.to_string(v)

  defp json(v) when is_binary(v) do
    escaped =
      for <<c::utf8 <- v>>, into: "" do
        case c do
          ?" -> "\\\""
          ?\\ -> "\\\\"
          c when c < 0x20 -> "\\u" <> String.pad_leading(Integer.to_string(c, 16), 4, "0")
          c -> <<c::utf8>>
        end
      end

    "\"" <> escaped <> "\""
  end

  defp json(v) when is_list(v), do: "[" <> Enum.map_join(v, ",", &json/1) <> "]"

  defp json(%{} = map) do
    "{" <> Enum.map_join(map, ",", fn {k, v} -> json(to_string(k)) <> ":" <> json(v) end) <> "}"
  end
end

EMLXAxon.Bench.main(System.argv())
