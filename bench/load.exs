# Load benchmark: continuous batching (EMLXAxon.Scheduler) against static
# batches (each batch of waiting requests decoded to its end with
# EMLXAxon.Qwen3.Generate, as a plain batching server does), in one run, on
# the same model and the same arrivals.
#
#   mix run bench/load.exs -- [--model DIR] [--requests N] [--gap-ms MS]
#       [--slots S] [--seed SEED] [--dtype float32|bfloat16]
#       [--prefill-chunk TOKENS] [--serving-only]
#
# Scenario 1: N requests with Poisson arrivals (mean gap MS), mixed prompt
# lengths (8, 32, 96 tokens) and answer lengths (16, 32, 64 tokens), EOS
# ignored. Reported per mode: aggregate throughput (requested tokens over
# the time from the first arrival to the last answer), time to first token
# p50/p95, and total time.
#
# Scenario 2: S - 1 requests of 64 tokens start together; one more arrives
# 300 ms later. Reported: its time to first token against the busy batch's
# total time.
#
# Scenario 3: two requests, one after the other on an idle scheduler, share
# a 1,000-token system prompt and differ in their last 24 tokens. Reported:
# each one's time to first token, with the prefix cache and without it
# (a second scheduler with `prefix_cache_bytes: 0`), and the second's as a
# share of the first's.
#
# Scenario 4 (where Nx is loaded): the same race through a real
# Nx.Serving process (batch_size 8), as users run it: 7 streaming callers
# merged into one batch of 200-token answers, then one more caller once
# they decode. Reported for the default serving (continuous batching
# through its own scheduler) and a static one (`scheduler: false`): the
# late caller's first token, as a share of the time the batch took from
# its arrival. `--serving-only` runs this scenario alone.
#
# Nothing measured pays a first use: scenario 1 starts after an unmeasured
# pass of every static batch size and as many concurrent scheduler requests,
# and each scheduler of scenario 3 first serves two unmeasured requests of
# the same lengths with another system prompt.

defmodule EMLXAxon.LoadBench do
  alias EMLXAxon.Scheduler
  alias EMLXAxon.Qwen3.{Generate, Loader}

  @switches [
    model: :string,
    requests: :integer,
    gap_ms: :integer,
    slots: :integer,
    prefill_chunk: :integer,
    seed: :integer,
    dtype: :string,
    serving_only: :boolean
  ]

  def main(argv) do
    {opts, _, _} = OptionParser.parse(argv -- ["--"], strict: @switches)
    model = opts[:model] || Path.expand("../.cache/fixtures/qwen3-4bit-g64", __DIR__)
    n = opts[:requests] || 24
    gap = opts[:gap_ms] || 40
    slots = opts[:slots] || 8
    chunk = if opts[:prefill_chunk], do: [prefill_chunk: opts[:prefill_chunk]], else: []
    :rand.seed(:exsss, {opts[:seed] || 1, 2, 3})

    load_opts = if opts[:dtype], do: [dtype: String.to_atom(opts[:dtype])], else: []
    state = Loader.load!(model, load_opts)
    vocab = min(state.config.vocab_size, 150_000)

    IO.puts(
      "model #{model} (#{state.config.dtype}), #{EMLXAxon.mlx_info().default_device}, " <>
        "#{n} requests, mean gap #{gap} ms, #{slots} slots, prefill chunk " <>
        "#{Keyword.get(chunk, :prefill_chunk, "default")}"
    )

    requests =
      for _ <- 1..n do
        len = Enum.random([8, 32, 96])

        %{
          prompt: Enum.map(1..len, fn _ -> :rand.uniform(vocab - 1) end),
          tokens: Enum.random([16, 32, 64])
        }
      end

    arrivals =
      Enum.map_reduce(requests, 0.0, fn r, t ->
        t = t - gap * :math.log(1.0 - :rand.uniform())
        {Map.put(r, :at, round(t)), t}
      end)
      |> elem(0)

    unless opts[:serving_only], do: scenarios(state, model, requests, arrivals, vocab, slots, chunk, n)
    serving_race(state, model)
  end

  defp scenarios(state, _model, requests, arrivals, vocab, slots, chunk, n) do
    {:ok, server} = Scheduler.start_link([model: state, slots: slots, max_queue: n] ++ chunk)

    warm_up(state, server, requests, slots)

    IO.puts("\nScenario 1: Poisson arrivals")
    static = run_static(state, arrivals, slots)
    continuous = run_continuous(server, arrivals)
    report("static batches", static)
    report("scheduler", continuous)

    IO.puts(
      "throughput ratio (scheduler / static): " <>
        "#{Float.round(throughput(continuous) / throughput(static), 2)}x"
    )

    IO.puts("\nScenario 2: one request arriving 300 ms into a busy batch")
    busy = for r <- Enum.take(requests, slots - 1), do: %{r | tokens: 64} |> Map.put(:at, 0)
    late = %{prompt: hd(requests).prompt, tokens: 16, at: 300}

    for {name, results} <- [
          {"static batches", run_static(state, busy ++ [late], slots)},
          {"scheduler", run_continuous(server, busy ++ [late])}
        ] do
      last = List.last(results)
      batch_ms = results |> Enum.take(slots - 1) |> Enum.map(& &1.done) |> Enum.max()

      IO.puts(
        "  #{String.pad_trailing(name, 16)} late request's first token after " <>
          "#{round(last.first - last.at)} ms; the busy batch took #{round(batch_ms)} ms"
      )
    end

    IO.puts("\nScenario 3: a second request with the same 1,000-token system prompt")
    system = Enum.map(1..1000, fn _ -> :rand.uniform(vocab - 1) end)

    [first, second] =
      for _ <- 1..2, do: system ++ Enum.map(1..24, fn _ -> :rand.uniform(vocab - 1) end)

    {:ok, cold} =
      Scheduler.start_link([model: state, slots: slots, prefix_cache_bytes: 0] ++ chunk)

    for {name, s} <- [{"prefix cache on", server}, {"prefix cache off", cold}] do
      # Unmeasured: the same lengths with another system prompt, a prefix
      # hit included where the cache is on.
      other = Enum.map(1..1000, fn _ -> :rand.uniform(vocab - 1) end)
      for p <- [first, second], do: first_token_ms(s, other ++ Enum.take(p, -24))
      [a, b] = for p <- [first, second], do: first_token_ms(s, p)

      IO.puts(
        "  #{String.pad_trailing(name, 16)} first request #{round(a)} ms, second #{round(b)} ms " <>
          "(#{Float.round(b / a * 100, 1)}% of the first)"
      )
    end

    Scheduler.stop(cold)
    Scheduler.stop(server)
  end

  # Unmeasured: every batch size of the static path on this run's prompts,
  # and as many concurrent requests through the scheduler, so that neither
  # mode pays first-use costs in the measured runs (on a GPU, MLX compiles
  # kernels and plans products for each new shape).
  # Scenario 4: a late caller of a busy Nx.Serving process.
  defp serving_race(state, model) do
    if Code.ensure_loaded?(Nx.Serving) do
      {:ok, _} = Application.ensure_all_started(:nx)
      {:ok, tokenizer} = EMLXAxon.Tokenizer.load(model)
      IO.puts("\nScenario 4: a caller arriving while an Nx.Serving batch decodes (batch_size 8)")

      for {name, opts} <- [{"default", []}, {"scheduler: false", [scheduler: false]}] do
        serving =
          EMLXAxon.TextGeneration.serving(
            tokenizer,
            state,
            [max_new_tokens: 200, ignore_eos: true, stream: true] ++ opts
          )

        {:ok, sup} =
          Nx.Serving.start_link(serving: serving, name: LoadBench.Serving, batch_size: 8, batch_timeout: 20)

        # Unmeasured: a first batch pays the first use.
        race(LoadBench.Serving)
        {first, batch} = race(LoadBench.Serving)

        IO.puts(
          "  #{String.pad_trailing(name, 18)} late caller's first token after #{first} ms; " <>
            "the batch took #{batch} ms more (#{round(first / batch * 100)}% of it)"
        )

        Supervisor.stop(sup)
      end
    else
      IO.puts("\nScenario 4 left out: Nx is not loaded")
    end
  end

  defp race(name) do
    test = self()

    batch =
      for i <- 1..7 do
        Task.async(fn ->
          name
          |> Nx.Serving.batched_run("Request #{i}: tell me a story.")
          |> Stream.each(fn _ -> send(test, :decoding) end)
          |> Stream.run()

          System.monotonic_time(:millisecond)
        end)
      end

    receive do
      :decoding -> :ok
    after
      120_000 -> raise "the batch produced nothing in 2 minutes"
    end

    # Well into the batch's decoding.
    Process.sleep(200)
    sent = System.monotonic_time(:millisecond)

    late =
      Task.async(fn ->
        [_] = name |> Nx.Serving.batched_run("A late question.") |> Enum.take(1)
        System.monotonic_time(:millisecond)
      end)

    first = Task.await(late, 300_000) - sent
    batch_end = batch |> Task.await_many(300_000) |> Enum.max()
    flush()
    {first, batch_end - sent}
  end

  defp flush do
    receive do
      :decoding -> flush()
    after
      0 -> :ok
    end
  end

  defp warm_up(state, server, requests, slots) do
    batch = requests |> Enum.take(slots) |> Enum.map(&%{&1 | tokens: 2})

    for k <- 1..length(batch) do
      prompts = batch |> Enum.take(k) |> Enum.map(& &1.prompt)
      {:ok, _} = Generate.generate(state, prompts, max_new_tokens: 2, ignore_eos: true)
    end

    run_continuous(server, Enum.map(batch, &Map.put(&1, :at, 0)))
  end

  # Time to first token of one request on an otherwise idle scheduler.
  defp first_token_ms(server, prompt) do
    t0 = now()
    {:ok, ref} = Scheduler.submit(server, prompt, max_new_tokens: 2, ignore_eos: true)
    first = receive_first(ref)
    receive_done(ref)
    first - t0
  end

  # Each request in its own process, submitted at its arrival time.
  defp run_continuous(server, arrivals) do
    t0 = now()

    arrivals
    |> Enum.map(fn r ->
      Task.async(fn ->
        wait_until(t0 + r.at)

        {:ok, ref} =
          Scheduler.submit(server, r.prompt, max_new_tokens: r.tokens, ignore_eos: true)

        first = receive_first(ref)
        done = receive_done(ref)
        %{at: r.at, first: first - t0, done: done - t0, tokens: r.tokens}
      end)
    end)
    |> Task.await_many(:infinity)
  end

  defp receive_first(ref) do
    receive do
      {Scheduler, ^ref, {:tokens, _, _}} -> now()
    end
  end

  defp receive_done(ref) do
    receive do
      {Scheduler, ^ref, {:tokens, _, _}} -> receive_done(ref)
      {Scheduler, ^ref, {:done, _, _}} -> now()
    end
  end

  # One batch at a time: whatever arrived while the previous batch ran (up to
  # `slots`), decoded until its longest answer is done.
  defp run_static(state, arrivals, slots) do
    t0 = now()
    indexed = arrivals |> Enum.with_index() |> Enum.map(fn {r, i} -> Map.put(r, :index, i) end)
    loop_static(state, indexed, slots, t0, [])
  end

  defp loop_static(_state, [], _slots, _t0, done), do: Enum.sort_by(done, & &1.index)

  defp loop_static(state, pending, slots, t0, done) do
    elapsed = now() - t0
    first_at = hd(pending).at
    if first_at > elapsed, do: wait_until(t0 + first_at)
    # The sleep is rounded to whole milliseconds: the first arrival counts as
    # come even if it woke a fraction early.
    elapsed = max(now() - t0, first_at)
    {ready, rest} = Enum.split_with(pending, &(&1.at <= elapsed))
    {batch, later} = Enum.split(ready, slots)
    started = now() - t0
    max_tokens = batch |> Enum.map(& &1.tokens) |> Enum.max()

    {:ok, results} =
      Generate.generate(state, Enum.map(batch, & &1.prompt),
        max_new_tokens: max_tokens,
        ignore_eos: true,
        profile_timing: true
      )

    finished = now() - t0
    ttft = hd(results).timings.time_to_first_token_ms

    rows =
      for r <- batch,
          do: %{index: r.index, at: r.at, first: started + ttft, done: finished, tokens: r.tokens}

    loop_static(state, later ++ rest, slots, t0, done ++ rows)
  end

  defp report(name, results) do
    ttft = results |> Enum.map(&(&1.first - &1.at)) |> Enum.sort()

    IO.puts(
      "  #{String.pad_trailing(name, 16)} #{Float.round(throughput(results), 1)} tok/s aggregate, " <>
        "TTFT p50 #{round(pct(ttft, 50))} ms, p95 #{round(pct(ttft, 95))} ms, " <>
        "total #{round(Enum.max(Enum.map(results, & &1.done)))} ms"
    )
  end

  defp throughput(results) do
    span = Enum.max(Enum.map(results, & &1.done)) - Enum.min(Enum.map(results, & &1.at))
    Enum.sum(Enum.map(results, & &1.tokens)) / (span / 1000)
  end

  defp pct(sorted, p), do: Enum.at(sorted, min(length(sorted) - 1, div(length(sorted) * p, 100)))

  defp now, do: System.monotonic_time(:microsecond) / 1000

  defp wait_until(t) do
    ms = round(t - now())
    if ms > 0, do: Process.sleep(ms)
  end
end

EMLXAxon.LoadBench.main(System.argv())
