# Soak test: mixed load against one loaded model for N minutes, watching
# for leaks, crashes and wrong output.
#
#   mix run bench/soak.exs -- --minutes N [--model DIR] [--workers W]
#       [--sample-seconds S] [--max-growth PCT] [--seed SEED]
#
# W worker processes (default: 3x the dirty CPU schedulers, so there are
# always more generations than schedulers) each loop over a random mix of:
# run/4, stream/5, batched run/4, Generate on shared MLX streams, seeded
# sampling, callers killed mid-generation, timeouts, emit callbacks that
# raise, requests that must fail (prompt too long, bad options, closed
# streams, a KV cache that cannot fit, missing and corrupt checkpoints),
# streams opened and closed, and the model reloaded and dropped. Greedy
# outputs are checked against what the model gave, alone, at the start, so
# a wrong answer counts as a failure like an unexpected error.
#
# The first fifth of the run (at least 20 s) warms up. Then every worker
# stops, everything is garbage collected and the baseline is taken: RSS
# (VmRSS) and MLX's active memory. The load runs for the rest of the time,
# printing RSS and MLX memory every S seconds (default 10), then stops and
# is measured the same way. Verdict: no failures, MLX active memory back to
# its baseline byte for byte, and RSS growth under --max-growth percent
# (default 5). Exits 1 on failure.

defmodule EMLXAxon.Soak do
  alias EMLXAxon.{Error, TextGeneration, Tokenizer}
  alias EMLXAxon.Qwen3.{Generate, Loader}

  @switches [
    minutes: :float,
    model: :string,
    workers: :integer,
    sample_seconds: :integer,
    max_growth: :float,
    seed: :integer
  ]

  @prompts [
    "The quick brown fox",
    "Hello",
    "Once upon a time",
    "1, 2, 3,",
    [%{role: "user", content: "Hi!"}],
    [%{role: "user", content: "Name a colour."}],
    "¿Qué tal?",
    "def fib(n):"
  ]

  @reference_tokens 24

  # {action, weight}
  @actions [
    run: 20,
    stream: 15,
    batch: 10,
    generate_on_stream: 10,
    sampling: 5,
    cancel: 8,
    timeout: 5,
    emit_raise: 5,
    error: 10,
    stream_open_close: 7,
    reload: 5
  ]

  def main(argv) do
    opts = parse(argv)
    model = Path.expand(opts[:model] || default_model())
    seconds = round((opts[:minutes] || 1.0) * 60)
    workers = opts[:workers] || 3 * :erlang.system_info(:dirty_cpu_schedulers)
    sample_ms = (opts[:sample_seconds] || 10) * 1000
    max_growth = opts[:max_growth] || 5.0
    seed = opts[:seed] || 1

    context = setup(model)
    warmup = max(20, div(seconds, 5))

    IO.puts(
      "soak: #{seconds} s (#{warmup} s warm-up), #{workers} workers, model #{model}, " <>
        "MLX #{EMLXAxon.mlx_info().mlx_version}"
    )

    IO.puts("warming up...")
    warm = run_phase(context, workers, warmup * 1000, sample_ms, {seed, 0})
    baseline = quiesce()
    IO.puts("baseline: " <> describe(baseline))

    main = run_phase(context, workers, (seconds - warmup) * 1000, sample_ms, {seed, 1})
    final = quiesce()
    IO.puts("final:    " <> describe(final))

    # The shared model must still answer as it did at the start (this also
    # keeps it alive through the final measurement).
    still_right? = still_right?(context)
    File.rm_rf!(context.corrupt)
    verdict(warm, main, baseline, final, max_growth, still_right?)
  end

  defp still_right?(context) do
    Enum.all?(@prompts, fn prompt ->
      %{results: [%{token_ids: ids}]} =
        TextGeneration.run(context.tokenizer, context.state, prompt,
          max_new_tokens: @reference_tokens,
          ignore_eos: true
        )

      ids == context.references[prompt]
    end)
  end

  defp parse(argv) do
    argv = Enum.drop_while(argv, &(&1 == "--"))
    {opts, rest, invalid} = OptionParser.parse(argv, strict: @switches)

    if rest != [] or invalid != [] do
      IO.puts(:stderr, "unknown arguments: #{inspect(rest ++ invalid)}")
      System.halt(2)
    end

    opts
  end

  defp default_model, do: Path.join(File.cwd!(), ".cache/fixtures/qwen3-4bit-g64")

  ## Set-up: the model, its reference outputs and a corrupt checkpoint

  defp setup(model) do
    tokenizer = Tokenizer.load!(model)
    state = Loader.load!(model)

    references =
      Map.new(@prompts, fn prompt ->
        %{results: [%{token_ids: ids}]} =
          TextGeneration.run(tokenizer, state, prompt,
            max_new_tokens: @reference_tokens,
            ignore_eos: true
          )

        {prompt, ids}
      end)

    streams = for _ <- 1..3, do: EMLXAxon.Stream.new!(:cpu)

    %{
      model: model,
      tokenizer: tokenizer,
      state: state,
      references: references,
      streams: streams,
      corrupt: corrupt_copy(model)
    }
  end

  # A copy of the checkpoint whose weights are cut in half.
  defp corrupt_copy(model) do
    dir = Path.join(System.tmp_dir!(), "emlx_axon_soak_#{System.unique_integer([:positive])}")
    File.mkdir_p!(dir)
    File.cp!(Path.join(model, "config.json"), Path.join(dir, "config.json"))
    weights = File.read!(Path.join(model, "model.safetensors"))

    File.write!(
      Path.join(dir, "model.safetensors"),
      binary_part(weights, 0, div(byte_size(weights), 2))
    )

    dir
  end

  ## Phases

  defp run_phase(context, workers, duration_ms, sample_ms, {seed, phase}) do
    # 1: operations, 2: failures, then one per action.
    counters = :counters.new(2 + length(@actions), [:write_concurrency])
    deadline = System.monotonic_time(:millisecond) + duration_ms
    parent = self()

    pids =
      for i <- 1..workers do
        spawn_link(fn ->
          :rand.seed(:exsss, {seed, phase, i})
          worker(context, counters, parent, deadline)
        end)
      end

    started = System.monotonic_time(:millisecond)
    samples = sample_until(deadline, sample_ms, counters, started, [])
    failures = collect_workers(pids, [])

    actions =
      Map.new(@actions, fn {action, _} ->
        {action, :counters.get(counters, action_index(action))}
      end)

    %{ops: :counters.get(counters, 1), failures: failures, samples: samples, actions: actions}
  end

  defp action_index(action),
    do: 3 + Enum.find_index(@actions, &(elem(&1, 0) == action))

  defp worker(context, counters, parent, deadline) do
    if System.monotonic_time(:millisecond) < deadline do
      action = pick_action()

      try do
        act(action, context)
        :counters.add(counters, 1, 1)
        :counters.add(counters, action_index(action), 1)
      rescue
        e -> failure(parent, counters, action, Exception.format(:error, e, __STACKTRACE__))
      catch
        kind, reason ->
          failure(parent, counters, action, Exception.format(kind, reason, __STACKTRACE__))
      end

      worker(context, counters, parent, deadline)
    else
      send(parent, {:worker_done, self()})
    end
  end

  defp failure(parent, counters, action, message) do
    :counters.add(counters, 2, 1)
    send(parent, {:failure, action, message})
  end

  defp collect_workers([], failures), do: Enum.reverse(failures)

  defp collect_workers(pids, failures) do
    receive do
      {:worker_done, pid} ->
        collect_workers(List.delete(pids, pid), failures)

      {:failure, action, message} ->
        IO.puts(:stderr, "FAILURE in #{action}:\n#{message}")
        collect_workers(pids, [{action, message} | failures])
    after
      300_000 ->
        IO.puts(:stderr, "FAILURE: workers did not finish: #{inspect(pids)} (a hang?)")
        Enum.reverse([{:hang, inspect(pids)} | failures])
    end
  end

  defp sample_until(deadline, sample_ms, counters, started, samples) do
    now = System.monotonic_time(:millisecond)

    if now >= deadline do
      Enum.reverse(samples)
    else
      Process.sleep(min(sample_ms, deadline - now))
      sample = sample(counters, started)
      IO.puts(describe(sample))
      sample_until(deadline, sample_ms, counters, started, [sample | samples])
    end
  end

  defp sample(counters, started) do
    Map.merge(EMLXAxon.memory_info(), %{
      rss: rss(),
      elapsed_s: (System.monotonic_time(:millisecond) - started) / 1000,
      ops: :counters.get(counters, 1),
      failures: :counters.get(counters, 2)
    })
  end

  # With no work running: collects everything, so that dropped models and
  # killed generations are freed, and lets MLX's count settle.
  defp quiesce do
    Enum.reduce_while(1..100, nil, fn _, previous ->
      for pid <- Process.list(), do: :erlang.garbage_collect(pid)
      Process.sleep(50)
      memory = EMLXAxon.memory_info()
      if previous && previous.active == memory.active, do: {:halt, memory}, else: {:cont, memory}
    end)
    |> Map.put(:rss, rss())
  end

  defp rss do
    [kb] =
      Regex.run(~r/VmRSS:\s+(\d+) kB/, File.read!("/proc/self/status"), capture: :all_but_first)

    String.to_integer(kb) * 1024
  end

  defp describe(m) do
    time =
      if m[:elapsed_s], do: "#{:erlang.float_to_binary(m.elapsed_s, decimals: 0)} s  ", else: ""

    ops = if m[:ops], do: "  ops #{m.ops}  failures #{m.failures}", else: ""

    "#{time}RSS #{mb(m.rss)}  MLX active #{mb(m.active)} peak #{mb(m.peak)} cache #{mb(m.cache)}#{ops}"
  end

  defp mb(bytes), do: "#{:erlang.float_to_binary(bytes / 1_048_576, decimals: 1)} MB"

  defp verdict(warm, main, baseline, final, max_growth, still_right?) do
    growth = (final.rss - baseline.rss) / baseline.rss * 100
    failures = warm.failures ++ main.failures
    leaked = final.active - baseline.active
    rates = Enum.map(main.samples, & &1.rss)

    IO.puts("""

    operations: #{warm.ops} warm-up + #{main.ops} measured, #{length(failures)} failures
    measured, by kind: #{Enum.map_join(@actions, ", ", fn {a, _} -> "#{a} #{main.actions[a]}" end)}
    RSS: baseline #{mb(baseline.rss)}, final #{mb(final.rss)}, growth #{Float.round(growth, 2)}% \
    (under load: #{mb(Enum.min(rates, fn -> 0 end))} to #{mb(Enum.max(rates, fn -> 0 end))})
    MLX active: baseline #{baseline.active} B, final #{final.active} B (#{leaked} B leaked), \
    peak #{mb(Enum.max(Enum.map(main.samples, & &1.peak), fn -> 0 end))}\
    """)

    checks = [
      {failures == [], "no failures"},
      {leaked == 0, "MLX active memory back to its baseline"},
      {growth < max_growth, "RSS growth under #{max_growth}%"},
      {still_right?, "the shared model still gives its reference outputs"}
    ]

    for {ok?, what} <- checks, do: IO.puts("#{if ok?, do: "PASS", else: "FAIL"}  #{what}")

    if Enum.all?(checks, &elem(&1, 0)) do
      IO.puts("verdict: PASS")
    else
      IO.puts("verdict: FAIL")
      System.halt(1)
    end
  end

  ## Actions

  defp pick_action do
    total = @actions |> Keyword.values() |> Enum.sum()
    pick(@actions, :rand.uniform(total))
  end

  defp pick([{action, weight} | _], n) when n <= weight, do: action
  defp pick([{_, weight} | rest], n), do: pick(rest, n - weight)

  defp random_prompt, do: Enum.random(@prompts)

  defp act(:run, c) do
    prompt = random_prompt()
    n = :rand.uniform(@reference_tokens)

    %{results: [result]} =
      TextGeneration.run(c.tokenizer, c.state, prompt, max_new_tokens: n, ignore_eos: true)

    check_ids!(c, prompt, result.token_ids, n)
  end

  defp act(:stream, c) do
    prompt = random_prompt()
    n = :rand.uniform(@reference_tokens)
    key = make_ref()
    opts = [max_new_tokens: n, ignore_eos: true, chunk_size: :rand.uniform(6)]

    %{results: [result]} =
      TextGeneration.stream(c.tokenizer, c.state, prompt, &send(self(), {key, &1}), opts)

    check_ids!(c, prompt, result.token_ids, n)
    chunks = drain(key, [])

    check!(
      IO.iodata_to_binary(chunks) == result.generated_text,
      "streamed chunks differ from the text"
    )
  end

  defp act(:batch, c) do
    prompts = Enum.map(1..(1 + :rand.uniform(3)), fn _ -> random_prompt() end)
    n = :rand.uniform(@reference_tokens)

    outputs =
      TextGeneration.run(c.tokenizer, c.state, prompts, max_new_tokens: n, ignore_eos: true)

    check!(length(outputs) == length(prompts), "a batch lost a request")

    for {prompt, %{results: [result]}} <- Enum.zip(prompts, outputs),
        do: check_ids!(c, prompt, result.token_ids, n)
  end

  defp act(:generate_on_stream, c) do
    prompt = random_prompt()
    {:ok, ids} = encode(c, prompt)
    stream = Enum.random(c.streams)
    n = :rand.uniform(@reference_tokens)

    {:ok, %{token_ids: generated}} =
      Generate.generate(c.state, ids, max_new_tokens: n, ignore_eos: true, stream: stream)

    check_ids!(c, prompt, generated, n)
  end

  defp act(:sampling, c) do
    opts = [
      max_new_tokens: 8,
      sampler: Enum.random([:top_p_cpu, :top_p_gpu]),
      seed: :rand.uniform(1000)
    ]

    prompt = random_prompt()
    first = TextGeneration.run(c.tokenizer, c.state, prompt, opts).results

    check!(
      TextGeneration.run(c.tokenizer, c.state, prompt, opts).results == first,
      "seeded sampling differs"
    )
  end

  defp act(:cancel, c) do
    parent = self()
    key = make_ref()

    {pid, ref} =
      spawn_monitor(fn ->
        TextGeneration.stream(
          c.tokenizer,
          c.state,
          random_prompt(),
          fn _ -> send(parent, key) end,
          max_new_tokens: 20_000,
          max_len: 20_100,
          ignore_eos: true,
          chunk_size: Enum.random([1, 4])
        )
      end)

    receive do
      ^key ->
        Process.exit(pid, :kill)

      {:DOWN, ^ref, _, _, reason} ->
        raise "the generation to cancel died first: #{inspect(reason)}"
    after
      60_000 -> raise "no first chunk within 60 s"
    end

    receive do
      {:DOWN, ^ref, _, _, :killed} -> drain(key)
    after
      10_000 -> raise "a killed generation did not go down"
    end
  end

  defp act(:timeout, c) do
    %{results: [result]} =
      TextGeneration.run(c.tokenizer, c.state, random_prompt(),
        max_new_tokens: 20_000,
        max_len: 20_100,
        ignore_eos: true,
        chunk_size: 2,
        timeout: 5 + :rand.uniform(45)
      )

    check!(result.finish_reason == :timeout, "expected a timeout, got #{result.finish_reason}")
  end

  defp act(:emit_raise, c) do
    try do
      TextGeneration.stream(
        c.tokenizer,
        c.state,
        random_prompt(),
        fn _ -> raise ArithmeticError end,
        max_new_tokens: 1000,
        ignore_eos: true
      )

      raise "emit_fun's exception did not propagate"
    rescue
      ArithmeticError -> :ok
    end
  end

  defp act(:error, c) do
    case :rand.uniform(6) do
      1 ->
        expect_raise(Error, fn ->
          TextGeneration.run(c.tokenizer, c.state, "The quick brown fox", max_len: 2)
        end)

      2 ->
        expect_raise(ArgumentError, fn ->
          TextGeneration.run(c.tokenizer, c.state, "x", max_new_tokens: 0)
        end)

      3 ->
        expect_error(:io, Loader.load("/no/such/checkpoint"))

      4 ->
        expect_error(:safetensors, Loader.load(c.corrupt))

      5 ->
        expect_error(
          :out_of_memory,
          Generate.generate(c.state, [1, 2], max_new_tokens: 2 ** 31 - 10, max_len: 2 ** 31 - 1)
        )

      6 ->
        expect_raise(ArgumentError, fn -> TextGeneration.run(c.tokenizer, c.state, <<0xFF>>) end)
    end
  end

  defp act(:stream_open_close, c) do
    stream = EMLXAxon.Stream.new!(:cpu)
    prompt = random_prompt()

    %{results: [result]} =
      TextGeneration.run(c.tokenizer, c.state, prompt,
        max_new_tokens: 4,
        ignore_eos: true,
        stream: stream
      )

    check_ids!(c, prompt, result.token_ids, 4)
    :ok = EMLXAxon.Stream.close(stream)

    expect_raise(Error, fn -> TextGeneration.run(c.tokenizer, c.state, prompt, stream: stream) end)
  end

  defp act(:reload, c) do
    state = Loader.load!(c.model)
    prompt = random_prompt()

    %{results: [result]} =
      TextGeneration.run(c.tokenizer, state, prompt, max_new_tokens: 6, ignore_eos: true)

    check_ids!(c, prompt, result.token_ids, 6)
  end

  defp encode(c, prompt) when is_binary(prompt), do: Tokenizer.encode(c.tokenizer, prompt)

  defp encode(c, messages) do
    {:ok, text} = Tokenizer.apply_chat_template(c.tokenizer, messages)
    Tokenizer.encode(c.tokenizer, text)
  end

  defp check_ids!(c, prompt, ids, n) do
    expected = Enum.take(c.references[prompt], n)

    check!(
      ids == expected,
      "#{inspect(prompt)}: got #{inspect(ids)}, expected #{inspect(expected)}"
    )
  end

  defp check!(true, _message), do: :ok
  defp check!(false, message), do: raise("wrong output: " <> message)

  defp expect_raise(module, fun) do
    fun.()
    raise "expected #{inspect(module)}"
  rescue
    e -> if is_struct(e, module), do: :ok, else: reraise(e, __STACKTRACE__)
  end

  defp expect_error(kind, {:error, %Error{kind: kind}}), do: :ok
  defp expect_error(kind, other), do: raise("expected a #{kind} error, got #{inspect(other)}")

  defp drain(key, acc) do
    receive do
      {^key, chunk} -> drain(key, [chunk | acc])
    after
      0 -> Enum.reverse(acc)
    end
  end

  defp drain(key) do
    receive do
      ^key -> drain(key)
    after
      0 -> :ok
    end
  end
end

EMLXAxon.Soak.main(System.argv())
