defmodule EMLXAxon.SchedulerTest do
  # Continuous batching through the scheduler process: requests from many
  # processes joining a running batch, per-request options, cancellation by
  # exit, cancel/2 or timeout, overload, the prefix cache and memory. Not
  # async: the leak check reads MLX's global memory figures.
  use ExUnit.Case, async: false

  import EMLXAxon.TestMemory

  alias EMLXAxon.{Scheduler, TestFixtures}
  alias EMLXAxon.Qwen3.Generate

  @moduletag :fixtures
  @moduletag timeout: 300_000

  @fixture "qwen3-4bit-g64"

  setup_all do
    state = TestFixtures.model(@fixture)
    ref = TestFixtures.reference(@fixture)
    prompts = ref["prompts"] |> Enum.sort() |> Enum.map(fn {_name, p} -> p["prompt_ids"] end)

    %{
      state: state,
      tokenizer: TestFixtures.tokenizer(@fixture),
      reference: ref,
      prompts: prompts
    }
  end

  defp start(ctx, opts) do
    start_supervised!({Scheduler, Keyword.merge([model: ctx.state, prefix_cache_bytes: 0], opts)})
  end

  defp solo(state, prompt, opts) do
    {:ok, %{token_ids: ids}} = Generate.generate(state, prompt, opts)
    ids
  end

  defp await_idle(server, ms \\ 5_000) do
    deadline = System.monotonic_time(:millisecond) + ms

    Stream.repeatedly(fn ->
      occupancy = Scheduler.occupancy(server)

      if occupancy.running + occupancy.waiting == 0 or
           System.monotonic_time(:millisecond) > deadline do
        occupancy
      else
        Process.sleep(5)
        nil
      end
    end)
    |> Enum.find(& &1)
  end

  test "requests joining at different times get their solo greedy ids", ctx do
    server = start(ctx, slots: 3, prefill_chunk: 4, steps_per_call: 1)
    [chat, plain] = ctx.prompts
    short = Enum.take(plain, 3)
    long = chat ++ plain
    cases = [{chat, 16}, {plain, 10}, {short, 12}, {long, 9}, {plain, 5}]

    tasks =
      cases
      |> Enum.with_index()
      |> Enum.map(fn {{prompt, n}, i} ->
        Task.async(fn ->
          Process.sleep(i * 15)
          {:ok, result} = Scheduler.generate(server, prompt, max_new_tokens: n, ignore_eos: true)
          result
        end)
      end)

    results = Task.await_many(tasks, 60_000)

    for {{prompt, n}, result} <- Enum.zip(cases, results) do
      assert result.ids == solo(ctx.state, prompt, max_new_tokens: n, ignore_eos: true)
      assert result.finish_reason == :length
      assert result.stats.generated_tokens == n
      assert result.stats.prompt_tokens == length(prompt)
    end

    [chat_ref, plain_ref] =
      ctx.reference["prompts"] |> Enum.sort() |> Enum.map(fn {_, p} -> p["greedy_ids"] end)

    assert hd(results).ids == chat_ref
    assert Enum.at(results, 1).ids == Enum.take(plain_ref, 10)
    assert %{running: 0, waiting: 0, slots: 3} = Scheduler.occupancy(server)
  end

  test "each request keeps its own sampler, seed and stop string", ctx do
    server = start(ctx, slots: 4, tokenizer: ctx.tokenizer)
    [chat, plain] = ctx.prompts

    sampled = fn sampler, seed ->
      [
        max_new_tokens: 12,
        ignore_eos: true,
        sampler: sampler,
        temperature: 0.8,
        top_p: 0.9,
        top_k: 20,
        seed: seed
      ]
    end

    greedy_ids = solo(ctx.state, plain, max_new_tokens: 16, ignore_eos: true)
    {k, before, stop} = TestFixtures.stop_string(ctx.tokenizer, greedy_ids)

    cases = [
      {chat, sampled.(:top_p_gpu, 7)},
      {chat, sampled.(:top_p_cpu, 11)},
      {plain, [max_new_tokens: 16, ignore_eos: true, stop: [stop]]},
      {plain, sampled.(:top_p_gpu, 7)}
    ]

    results =
      cases
      |> Enum.map(fn {prompt, opts} ->
        Task.async(fn -> Scheduler.generate(server, prompt, opts) end)
      end)
      |> Task.await_many(60_000)

    for {{prompt, opts}, {:ok, result}} <- Enum.zip(cases, results) do
      {:ok, %{token_ids: ids}} =
        Generate.generate(ctx.state, prompt, Keyword.put(opts, :tokenizer, ctx.tokenizer))

      assert result.ids == ids
    end

    {:ok, stopped} = Enum.at(results, 2)
    assert stopped.finish_reason == :stop
    assert stopped.text == before
    assert length(stopped.ids) == k + 1
  end

  test "a text prompt, streaming and the prefix cache", ctx do
    server =
      start(ctx,
        tokenizer: ctx.tokenizer,
        prefix_cache_bytes: 64 * 1024 * 1024,
        prefix_min_tokens: 4,
        # Two steps a call: the stream comes in several pieces.
        steps_per_call: 2
      )

    system = String.duplicate("You are a careful assistant. ", 4)
    first = system <> "Say hello."
    second = system <> "Count to three."

    {:ok, cold} = Scheduler.generate(server, first, max_new_tokens: 8, ignore_eos: true)
    assert cold.stats.cached_tokens == 0

    chunks =
      Scheduler.stream(server, second, max_new_tokens: 8, ignore_eos: true) |> Enum.to_list()

    assert length(chunks) >= 2
    ids = Enum.flat_map(chunks, &elem(&1, 0))
    {:ok, second_ids} = EMLXAxon.Tokenizer.encode(ctx.tokenizer, second)
    assert ids == solo(ctx.state, second_ids, max_new_tokens: 8, ignore_eos: true)

    {:ok, again} = Scheduler.generate(server, first, max_new_tokens: 8, ignore_eos: true)
    assert again.ids == cold.ids
    assert again.text == cold.text
    assert again.stats.cached_tokens == again.stats.prompt_tokens - 1
    assert %{prefix_entries: entries} = Scheduler.occupancy(server)
    assert entries >= 1
    assert :ok = Scheduler.clear_prefix_cache(server)
    assert %{prefix_entries: 0, prefix_bytes: 0} = Scheduler.occupancy(server)
  end

  test "a caller's exit drops its request, mid-prefill and mid-decode", ctx do
    server = start(ctx, slots: 1, prefill_chunk: 1, steps_per_call: 1)
    [chat, plain] = ctx.prompts
    long = List.flatten(List.duplicate(chat ++ plain, 5))

    # Mid-prefill: one token per step of a 140-token prompt.
    caller =
      spawn(fn ->
        Scheduler.submit(server, long, max_new_tokens: 50) && Process.sleep(:infinity)
      end)

    Process.sleep(5)
    assert %{waiting: 1, running: 0} = Scheduler.occupancy(server)
    Process.exit(caller, :kill)
    assert %{waiting: 0, running: 0} = await_idle(server)

    # Mid-decode.
    test = self()

    caller =
      spawn(fn ->
        {:ok, ref} = Scheduler.submit(server, plain, max_new_tokens: 500, ignore_eos: true)

        receive do
          {Scheduler, ^ref, {:tokens, _, _}} -> send(test, :decoding)
        end

        Process.sleep(:infinity)
      end)

    assert_receive :decoding, 5_000
    assert %{running: 1} = Scheduler.occupancy(server)
    Process.exit(caller, :kill)
    assert %{waiting: 0, running: 0} = await_idle(server)

    # The freed slot serves the next request correctly.
    {:ok, result} = Scheduler.generate(server, plain, max_new_tokens: 6, ignore_eos: true)
    assert result.ids == solo(ctx.state, plain, max_new_tokens: 6, ignore_eos: true)
  end

  test "cancel/2, timeouts and overload", ctx do
    server = start(ctx, slots: 1, max_queue: 1, steps_per_call: 1)
    [_chat, plain] = ctx.prompts
    opts = [max_new_tokens: 1000, max_len: 2000, ignore_eos: true]

    {:ok, running} = Scheduler.submit(server, plain, opts)
    {:ok, queued} = Scheduler.submit(server, plain, opts)
    assert {:error, :overloaded} = Scheduler.submit(server, plain, opts)

    assert_receive {Scheduler, ^running, {:tokens, _, _}}, 5_000
    :ok = Scheduler.cancel(server, running)
    # The queued request takes the freed slot.
    assert_receive {Scheduler, ^queued, {:tokens, _, _}}, 5_000
    :ok = Scheduler.cancel(server, queued)
    assert %{running: 0, waiting: 0} = await_idle(server)

    {:ok, timed} = Scheduler.submit(server, plain, [timeout: 50] ++ opts)
    assert_receive {Scheduler, ^timed, {:done, :timeout, _}}, 5_000
    assert %{running: 0, waiting: 0} = await_idle(server)

    assert_raise ArgumentError, ~r/token ids/, fn -> Scheduler.submit(server, [-1]) end
    assert_raise ArgumentError, ~r/tokenizer/, fn -> Scheduler.submit(server, "text") end
    assert_raise ArgumentError, fn -> Scheduler.submit(server, plain, bogus: 1) end

    assert {:error, %EMLXAxon.Error{kind: :invalid_argument}} =
             Scheduler.submit(server, [10_000_000])

    # Slots keep float caches: a quantized one is refused, not ignored.
    assert {:error, %EMLXAxon.Error{kind: :invalid_argument, message: message}} =
             Scheduler.submit(server, plain, kv_bits: 8, kv_group_size: 32)

    assert message =~ "kv_bits and max_kv_size are not offered by the scheduler"

    assert {:error, %EMLXAxon.Error{message: message}} =
             Scheduler.submit(server, plain, max_kv_size: 64)

    assert message =~ "not offered by the scheduler"

    # A cache dtype is the slots' (float16 by default under the CPU's
    # float32, bfloat16 on a GPU): one asking for another is refused.
    assert {:error, %EMLXAxon.Error{message: message}} =
             Scheduler.submit(server, plain, kv_dtype: :float32)

    assert message =~ ~r/slots keep (Float16|Bfloat16) keys and values, not the kv_dtype Float32/

    assert_raise ArgumentError, ~r/model/, fn -> Scheduler.start_link(model: nil) end

    assert_raise ArgumentError, ~r/:prefill_chunk/, fn ->
      Scheduler.start_link(model: ctx.state, prefill_chunk: :large)
    end
  end

  test "float16 slots decode as a float16 generation alone", ctx do
    server = start(ctx, slots: 2, kv_dtype: :float16)
    [_chat, plain] = ctx.prompts
    opts = [max_new_tokens: 12, ignore_eos: true]

    for asked <- [[kv_dtype: :float16], []] do
      assert {:ok, %{token_ids: ids}} = Scheduler.generate(server, plain, asked ++ opts)
      assert ids == solo(ctx.state, plain, [kv_dtype: :float16] ++ opts)
    end

    assert_raise ArgumentError, ~r/:kv_dtype/, fn ->
      Scheduler.start_link(model: ctx.state, kv_dtype: :int8)
    end
  end

  test "64 concurrent callers with random cancellations leave no memory behind", ctx do
    server = start(ctx, slots: 8, max_queue: 64, prefill_chunk: 16)
    [_chat, plain] = ctx.prompts
    warm = fn -> Scheduler.generate(server, plain, max_new_tokens: 4, ignore_eos: true) end
    # A first round fills the allocator's caches, so that RSS after the
    # second says whether anything stayed behind.
    crowd(server, ctx.prompts, {1, 2, 3})
    assert {:ok, _} = warm.()
    {before, rss_before} = {settled_active(), rss()}

    crowd(server, ctx.prompts, {4, 5, 6})
    # The slot cache keeps its last step's positions (4 bytes a row run):
    # end on the warm-up's shape so that the figures compare like with like.
    assert {:ok, _} = warm.()
    # A request left behind holds at least one position of KV cache; a few
    # bytes either way are the step's small bookkeeping arrays (positions,
    # sized by the last step's rows) or something of an earlier test's.
    one_position = kv_bytes(ctx.state, 1, 1)
    assert await_active(before) - before < one_position
    growth = growth(rss_before, rss())

    IO.puts(
      "\n64 callers with cancellations: RSS #{Float.round(growth, 2)}% over the round before"
    )

    assert growth < 5.0
  end

  # 64 callers with mixed prompts and lengths, each finishing, killed,
  # cancelled or timed out at random; returns once the scheduler is idle and
  # every caller is gone.
  defp crowd(server, [chat, plain], seed) do
    :rand.seed(:exsss, seed)

    callers =
      for i <- 1..64 do
        prompt = if rem(i, 2) == 0, do: chat, else: Enum.take(plain, 2 + rem(i, 8))
        n = 4 + rem(i * 7, 20)
        fate = Enum.random([:finish, :finish, :kill, :cancel, :timeout])

        pid =
          spawn(fn ->
            opts = [max_new_tokens: n, ignore_eos: true]
            opts = if fate == :timeout, do: [timeout: 30] ++ opts, else: opts
            {:ok, ref} = Scheduler.submit(server, prompt, opts)
            if fate == :cancel, do: Scheduler.cancel(server, ref)
            Process.sleep(:infinity)
          end)

        if fate == :kill,
          do: spawn(fn -> Process.sleep(:rand.uniform(50)) && Process.exit(pid, :kill) end)

        pid
      end

    assert %{running: 0, waiting: 0} = await_idle(server, 60_000)
    Enum.each(callers, &Process.exit(&1, :kill))
  end
end
