# Decode speed after a long prompt through one EMLXAxon.Scheduler (the
# default serving's path) with slots of the model's dtype against float16
# slots (`kv_dtype: :float16`), interleaved, one VM, every round printed.
#
#   mix run bench/kv_dtype.exs -- [--model DIR] [--prompt-len L] [--tokens T] [--rounds R]
#
# The prompt is L ids of a fixed pseudo-random sequence. Greedy, EOS ignored.

defmodule EMLXAxon.KvDtypeBench do
  alias EMLXAxon.Scheduler
  alias EMLXAxon.Qwen3.Loader

  @switches [model: :string, prompt_len: :integer, tokens: :integer, rounds: :integer]

  def main(argv) do
    {opts, _, _} = OptionParser.parse(argv -- ["--"], strict: @switches)
    model = opts[:model] || Path.expand("../.cache/fixtures/qwen3-4bit-g64", __DIR__)
    len = opts[:prompt_len] || 2048
    tokens = opts[:tokens] || 64
    state = Loader.load!(model)
    prompt = for i <- 1..len, do: rem(i * 7919 + 13, 100_000)
    IO.puts("model #{model} (#{state.config.dtype}), #{len}-token prompt, #{tokens} tokens")

    for round <- 1..(opts[:rounds] || 3), dtype <- [nil, :float16] do
      {:ok, server} =
        Scheduler.start_link(
          model: state,
          slots: 1,
          capacity: len + tokens + 1,
          prefix_cache_bytes: 0,
          kv_dtype: dtype
        )

      opts = [max_new_tokens: tokens, max_len: len + tokens + 1, ignore_eos: true]
      {:ok, %{metadata: m}} = Scheduler.generate(server, prompt, opts)
      GenServer.stop(server)

      IO.puts(
        "round #{round} kv_dtype #{inspect(dtype)}: decode #{Float.round(m.decode_tokens_per_s, 1)} " <>
          "tok/s, path #{m.decode_path}"
      )
    end
  end
end

EMLXAxon.KvDtypeBench.main(System.argv())
