defmodule EMLXAxon.TextGenerationSchedulerTest do
  # run/4 and stream/5 through an EMLXAxon.Scheduler (the :scheduler
  # option): the same outputs as a direct run, streamed pieces, per-input
  # seeds, cancellation when emit_fun raises, and refused combinations.
  use ExUnit.Case, async: false

  alias EMLXAxon.{Scheduler, TestFixtures, TextGeneration}

  @moduletag :fixtures
  @moduletag timeout: 300_000

  @fixture "qwen3-4bit-g64"
  @plain_text "The quick brown fox jumps over the lazy dog."
  @chat [%{role: "user", content: "Give me a short introduction to large language models."}]
  @opts [max_new_tokens: 16]

  setup_all do
    %{tokenizer: TestFixtures.tokenizer(@fixture), state: TestFixtures.model(@fixture)}
  end

  setup ctx do
    server =
      start_supervised!(
        # Two steps a call: streams come in several pieces.
        {Scheduler,
         model: ctx.state,
         tokenizer: ctx.tokenizer,
         slots: 4,
         prefix_cache_bytes: 0,
         steps_per_call: 2}
      )

    %{server: server}
  end

  # What a direct run and a scheduled one must agree on (padding and
  # timings differ by design).
  defp comparable(%{results: [result]}) do
    result
    |> Map.take([:generated_text, :text, :token_ids, :num_tokens, :finish_reason])
    |> Map.put(:input, result.token_summary.input)
  end

  test "greedy run/4 equals the direct run, one input and a list", ctx do
    %{tokenizer: tok, state: state, server: server} = ctx
    direct = TextGeneration.run(tok, state, @plain_text, @opts)
    scheduled = TextGeneration.run(tok, state, @plain_text, @opts ++ [scheduler: server])

    assert comparable(scheduled) == comparable(direct)
    assert %{results: [%{token_summary: %{padding: 0, output: 16}}]} = scheduled

    assert %{prompt_tokens: 10, generated_tokens: 16, batch_size: 1, total_ms: total} =
             scheduled.metadata

    assert total > 0

    inputs = [@plain_text, @chat, %{input_ids: Enum.take(hd(direct.results).token_ids, 3)}]
    direct_list = TextGeneration.run(tok, state, inputs, @opts)
    scheduled_list = TextGeneration.run(tok, state, inputs, @opts ++ [scheduler: server])

    assert length(scheduled_list) == 3
    assert Enum.map(scheduled_list, &comparable/1) == Enum.map(direct_list, &comparable/1)
    assert Enum.all?(scheduled_list, &(&1.metadata.batch_size == 3))
    assert %{running: 0, waiting: 0} = Scheduler.occupancy(server)
  end

  test "stream/5 emits pieces as tokens arrive that concatenate to the text", ctx do
    %{tokenizer: tok, state: state, server: server} = ctx
    test = self()

    output =
      TextGeneration.stream(
        tok,
        state,
        @chat,
        &send(test, {:piece, &1}),
        @opts ++ [scheduler: server]
      )

    pieces = collect_pieces()
    assert length(pieces) >= 2
    assert Enum.all?(pieces, &is_binary/1)
    assert Enum.join(pieces) == hd(output.results).generated_text
    assert comparable(output) == comparable(TextGeneration.run(tok, state, @chat, @opts))

    outputs =
      TextGeneration.stream(
        tok,
        state,
        [@plain_text, @chat],
        &send(test, {:piece, &1}),
        @opts ++ [scheduler: server]
      )

    pieces = collect_pieces()

    for {output, index} <- Enum.with_index(outputs) do
      text = for {^index, piece} <- pieces, into: "", do: piece
      assert text == hd(output.results).generated_text
      assert text != ""
    end

    assert Enum.all?(
             pieces,
             &match?({index, piece} when index in [0, 1] and is_binary(piece), &1)
           )
  end

  defp collect_pieces(acc \\ []) do
    receive do
      {:piece, piece} -> collect_pieces([piece | acc])
    after
      0 -> Enum.reverse(acc)
    end
  end

  test "each input samples with its own seed, as it does alone", ctx do
    %{tokenizer: tok, state: state, server: server} = ctx
    sampling = [max_new_tokens: 12, ignore_eos: true, sampler: :top_p_gpu, temperature: 0.9]
    inputs = [%{text: @plain_text, seed: 7}, %{messages: @chat, seed: 11}, %{text: "Hi", seed: 7}]

    scheduled = TextGeneration.run(tok, state, inputs, sampling ++ [scheduler: server])

    alone =
      Enum.map(inputs, fn input ->
        TextGeneration.run(tok, state, input, sampling ++ [scheduler: server])
      end)

    direct = Enum.map(inputs, &TextGeneration.run(tok, state, &1, sampling))

    assert Enum.map(scheduled, &comparable/1) == Enum.map(alone, &comparable/1)
    assert Enum.map(scheduled, &comparable/1) == Enum.map(direct, &comparable/1)

    # The :seed option seeds inputs without their own.
    reseeded =
      TextGeneration.run(tok, state, @plain_text, sampling ++ [seed: 7, scheduler: server])

    assert comparable(reseeded) == comparable(hd(scheduled))
  end

  test "an emit_fun that raises cancels the request", ctx do
    %{tokenizer: tok, state: state, server: server} = ctx
    long = [max_new_tokens: 1000, max_len: 1100, ignore_eos: true, scheduler: server]

    assert_raise RuntimeError, "stop here", fn ->
      TextGeneration.stream(tok, state, [@plain_text, @chat], fn _ -> raise "stop here" end, long)
    end

    assert %{running: 0, waiting: 0} = Scheduler.occupancy(server)
    refute_received {Scheduler, _, _}

    # A timeout ends the request like a direct run's.
    output = TextGeneration.run(tok, state, @plain_text, long ++ [timeout: 50])
    assert %{results: [%{finish_reason: :timeout}]} = output
    assert %{running: 0, waiting: 0} = Scheduler.occupancy(server)
  end

  test "combinations the scheduler cannot serve raise", ctx do
    %{tokenizer: tok, state: state, server: server} = ctx
    opts = @opts ++ [scheduler: server]

    stream = EMLXAxon.Stream.new!(:cpu)

    assert_raise ArgumentError, ~r/EMLXAxon.Stream/, fn ->
      TextGeneration.run(tok, state, @plain_text, opts ++ [mlx_stream: stream])
    end

    assert_raise ArgumentError, ~r/different model/, fn ->
      TextGeneration.run(tok, TestFixtures.model("qwen3-4bit-g128"), @plain_text, opts)
    end

    bare = start_supervised!({Scheduler, model: state}, id: :bare)

    assert_raise ArgumentError, ~r/:tokenizer/, fn ->
      TextGeneration.run(tok, state, @plain_text, @opts ++ [scheduler: bare])
    end

    assert_raise ArgumentError, ~r/expected :scheduler/, fn ->
      TextGeneration.run(tok, state, @plain_text, @opts ++ [scheduler: "server"])
    end

    dead = spawn(fn -> :ok end)
    Process.sleep(10)

    assert_raise ArgumentError, ~r/running EMLXAxon.Scheduler/, fn ->
      TextGeneration.stream(tok, state, @plain_text, & &1, @opts ++ [scheduler: dead])
    end

    assert %{running: 0, waiting: 0} = Scheduler.occupancy(server)
  end
end
