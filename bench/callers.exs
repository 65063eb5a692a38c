# Concurrent callers against one batch: N callers, each a process with its
# own prompt, through one EMLXAxon.Scheduler, against the engine's own batch
# of the same N prompts (EMLXAxon.Qwen3.Generate.generate/3), in one VM, on
# the same model and lengths. Both are timed with the wall clock from the
# call; the ratio is the callers' aggregate rate over the batch's.
#
#   mix run bench/callers.exs -- [--model DIR] [--callers N] [--prompt-len L]
#       [--tokens T] [--rounds R] [--steps-per-call S] [--ragged]
#
# --ragged: prompts of L - N + 1 .. L tokens, so that the batch is
# left-padded and attends through a mask, as the scheduler's rows always do.
# Greedy, EOS ignored. Run it in several fresh VMs: a GPU process can land
# in a slower state for its whole life.

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
    ragged: :boolean
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

    gen_opts = [max_new_tokens: tokens, ignore_eos: true]
    steps = Keyword.take(opts, [:steps_per_call])

    {:ok, server} = Scheduler.start_link([model: state, slots: n, prefix_cache_bytes: 0] ++ steps)

    IO.puts(
      "model #{model} (#{state.config.dtype}), #{EMLXAxon.mlx_info().default_device}, " <>
        "#{n} callers, prompts of #{Enum.min(Enum.map(prompts, &length/1))}-#{len} tokens, " <>
        "#{tokens} new tokens, steps per call #{Keyword.get(steps, :steps_per_call, "default")}"
    )

    batch = fn ->
      {:ok, rows} = Generate.generate(state, prompts, gen_opts)
      Enum.map(rows, & &1.token_ids)
    end

    callers = fn ->
      prompts
      |> Enum.map(fn p ->
        Task.async(fn ->
          {:ok, r} = Scheduler.generate(server, p, gen_opts)
          r.ids
        end)
      end)
      |> Task.await_many(:infinity)
    end

    # Warm-up: both paths' kernels for these shapes.
    batch.()
    callers.()

    for round <- 1..(opts[:rounds] || 3) do
      {tb, ids_b} = timed(batch)
      {tc, ids_c} = timed(callers)
      rate = fn ms -> Float.round(n * tokens / ms * 1000, 1) end

      IO.puts(
        "round #{round}: batch #{rate.(tb)} tok/s (#{round(tb)} ms), " <>
          "callers #{rate.(tc)} tok/s (#{round(tc)} ms); ratio #{Float.round(tb / tc, 3)}; " <>
          "same greedy ids: #{ids_b == ids_c}"
      )
    end
  end

  defp timed(fun) do
    started = System.monotonic_time(:microsecond)
    result = fun.()
    {(System.monotonic_time(:microsecond) - started) / 1000, result}
  end
end

EMLXAxon.CallersBench.main(System.argv())
