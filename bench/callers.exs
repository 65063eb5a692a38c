# Concurrent callers against one batch: N callers, each a process with its
# own prompt, through one EMLXAxon.Scheduler, against the engine's own batch
# of the same N prompts (EMLXAxon.Qwen3.Generate.generate/3), in one VM, on
# the same model and lengths. Both are timed with the wall clock from the
# call; the ratio is the callers' aggregate rate over the batch's.
#
#   mix run bench/callers.exs -- [--model DIR] [--callers N] [--prompt-len L]
#       [--tokens T] [--rounds R] [--steps-per-call S] [--ragged] [--sampled]
#       [--serving] [--trace]
#
# --ragged: prompts of L - N + 1 .. L tokens, so that the batch is
# left-padded and attends through a mask, as the scheduler's rows always do.
# --sampled: Qwen3's recommended sampling (temperature 0.6, top_p 0.95,
# top_k 20) on the device's sampler, each caller with its own seed, and the
# batch with seed 0 (the ids are then not compared). --serving: the callers
# go through the default Nx.Serving (`EMLXAxon.TextGeneration.serving/3`,
# continuous batching through its own scheduler, batch_size N) with
# `%{input_ids: ...}` inputs, as users call it; needs Nx. Greedy otherwise,
# EOS ignored. --trace (through a scheduler only): each caller's times of
# submission, answer, first and last token. Run it in several fresh VMs: a
# GPU process can land in a slower state for its whole life.

defmodule EMLXAxon.CallersBench do
  alias EMLXAxon.Scheduler
  alias EMLXAxon.Qwen3.{Generate, Loader}

  @switches [
    model: :string,
    callers: :integer,
    prompt_len: :integer,
    tokens: :integer,
    rounds: :integer,
    steps_per_call: :integer,
    ragged: :boolean,
    sampled: :boolean,
    serving: :boolean,
    trace: :boolean
  ]

  def main(argv) do
    {opts, _, _} = OptionParser.parse(argv -- ["--"], strict: @switches)
    model = opts[:model] || Path.expand("../.cache/fixtures/qwen3-4bit-g64", __DIR__)
    n = opts[:callers] || 8
    len = opts[:prompt_len] || 32
    tokens = opts[:tokens] || 64
    state = Loader.load!(model)

    :rand.seed(:exsss, {7, 8, 9})

    prompts =
      for i <- 1..n do
        own = if opts[:ragged], do: max(len - n + i, 1), else: len
        Enum.map(1..own, fn _ -> :rand.uniform(20_000) end)
      end

    sampling =
      if opts[:sampled],
        do: [sampler: :top_p_gpu, temperature: 0.6, top_p: 0.95, top_k: 20],
        else: []

    gen_opts = [max_new_tokens: tokens, ignore_eos: true] ++ sampling
    steps = Keyword.take(opts, [:steps_per_call])
    seeded = fn i -> if opts[:sampled], do: [seed: i], else: [] end

    if opts[:serving] && opts[:trace],
      do: raise(ArgumentError, "--trace follows callers through a scheduler, not --serving")

    call =
      if opts[:serving] do
        serving(model, state, n, gen_opts, steps)
      else
        {:ok, server} =
          Scheduler.start_link([model: state, slots: n, prefix_cache_bytes: 0] ++ steps)

        if opts[:trace] do
          fn {p, i} -> traced(server, p, gen_opts ++ seeded.(i)) end
        else
          fn {p, i} ->
            {:ok, r} = Scheduler.generate(server, p, gen_opts ++ seeded.(i))
            r.ids
          end
        end
      end

    IO.puts(
      "model #{model} (#{state.config.dtype}), #{EMLXAxon.mlx_info().default_device}, " <>
        "#{n} callers, prompts of #{Enum.min(Enum.map(prompts, &length/1))}-#{len} tokens, " <>
        "#{tokens} new tokens, steps per call #{Keyword.get(steps, :steps_per_call, "default")}, " <>
        "#{if opts[:sampled], do: "Qwen3 sampling", else: "greedy"}, " <>
        "callers through #{if opts[:serving], do: "the default Nx.Serving", else: "a scheduler"}"
    )

    batch = fn ->
      {:ok, rows} = Generate.generate(state, prompts, gen_opts ++ seeded.(0))
      Enum.map(rows, & &1.token_ids)
    end

    callers = fn ->
      prompts
      |> Enum.with_index(1)
      |> Enum.map(&Task.async(fn -> call.(&1) end))
      |> Task.await_many(:infinity)
    end

    # Warm-up: both paths' kernels for these shapes.
    batch.()
    callers.()

    for round <- 1..(opts[:rounds] || 3) do
      {tb, ids_b} = timed(batch)
      started = System.monotonic_time(:microsecond)
      {tc, ids_c} = timed(callers)
      ids_c = if opts[:trace], do: report_trace(ids_c, started), else: ids_c
      rate = fn ms -> Float.round(n * tokens / ms * 1000, 1) end

      IO.puts(
        "round #{round}: batch #{rate.(tb)} tok/s (#{round(tb)} ms), " <>
          "callers #{rate.(tc)} tok/s (#{round(tc)} ms); ratio #{Float.round(tb / tc, 3)}; " <>
          if(opts[:sampled], do: "sampled", else: "same greedy ids: #{ids_b == ids_c}")
      )
    end
  end

  # The default serving, as users start it; each caller's call.
  defp serving(model, state, n, gen_opts, steps) do
    unless Code.ensure_loaded?(Nx.Serving), do: raise("--serving needs Nx")
    {:ok, _} = Application.ensure_all_started(:nx)
    {:ok, tokenizer} = EMLXAxon.Tokenizer.load(model)
    scheduler = if steps == [], do: [], else: [scheduler_options: steps]
    # As Bumblebee's servings are configured: the serving's batch size given
    # to the serving (its scheduler's slots) and to Nx.Serving.
    sized = [compile: [batch_size: n]] ++ scheduler
    serving = EMLXAxon.TextGeneration.serving(tokenizer, state, gen_opts ++ sized)

    {:ok, _} = Nx.Serving.start_link(serving: serving, name: CallersBench.Serving, batch_size: n)

    fn {p, i} ->
      input =
        if Keyword.has_key?(gen_opts, :sampler),
          do: %{input_ids: p, seed: i},
          else: %{input_ids: p}

      %{results: [r]} = Nx.Serving.batched_run(CallersBench.Serving, input)
      r.token_ids
    end
  end

  # A caller through the scheduler's messages, with the times (from the
  # round's start) at which it submitted, got its first token and its last.
  defp traced(server, prompt, opts) do
    at = fn -> System.monotonic_time(:microsecond) end
    submitted = at.()
    {:ok, ref} = Scheduler.submit(server, prompt, opts)
    admitted = at.()
    collect_traced(ref, [], nil, {submitted, admitted})
  end

  defp collect_traced(ref, ids, first, times) do
    receive do
      {Scheduler, ^ref, {:tokens, new, _text}} ->
        first = first || System.monotonic_time(:microsecond)
        collect_traced(ref, ids ++ new, first, times)

      {Scheduler, ^ref, {:done, _reason, stats}} ->
        {submitted, admitted} = times
        done = System.monotonic_time(:microsecond)
        {ids, %{times: {submitted, admitted, first, done}, queue_ms: stats[:queue_ms]}}
    end
  end

  # Prints, per caller in submission order, when it submitted, was
  # answered, got its first token and its last (ms from the round's start);
  # returns the ids.
  defp report_trace(results, started) do
    ms = fn t -> Float.round((t - started) / 1000, 1) end

    results
    |> Enum.sort_by(fn {_ids, %{times: {s, _, _, _}}} -> s end)
    |> Enum.each(fn {_ids, %{times: {s, a, f, d}, queue_ms: q}} ->
      IO.puts(
        "  trace: submit #{ms.(s)} answered #{ms.(a)} first #{ms.(f)} done #{ms.(d)} queue_ms #{q}"
      )
    end)

    Enum.map(results, &elem(&1, 0))
  end

  defp timed(fun) do
    started = System.monotonic_time(:microsecond)
    result = fun.()
    {(System.monotonic_time(:microsecond) - started) / 1000, result}
  end
end

EMLXAxon.CallersBench.main(System.argv())
