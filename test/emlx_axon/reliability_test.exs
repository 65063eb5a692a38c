defmodule EMLXAxon.ReliabilityTest do
  # Not async: these tests load the machine on purpose.
  use ExUnit.Case, async: false

  import EMLXAxon.TestMemory

  alias EMLXAxon.{Error, TestCheckpoint, TestFixtures, TextGeneration}
  alias EMLXAxon.Qwen3.{Generate, Loader}

  @moduletag :fixtures
  @moduletag :reliability
  @moduletag timeout: 300_000

  @opts [max_new_tokens: 16]

  setup_all do
    name = "qwen3-4bit-g64"
    %{tokenizer: TestFixtures.tokenizer(name), state: TestFixtures.model(name)}
  end

  defp inputs do
    [
      "The quick brown fox",
      "Hello",
      [%{role: "user", content: "Hi!"}],
      "1, 2, 3,",
      "Once upon a time",
      "Elixir is",
      [%{role: "user", content: "Name a colour."}],
      "¿Qué tal?"
    ]
  end

  defp sixteen_inputs do
    inputs() ++
      [
        "Water boils at",
        %{input_ids: [9707, 11, 1879]},
        [%{role: "system", content: "Be brief."}, %{role: "user", content: "Why?"}],
        "日本語のテキスト",
        "def fib(n):",
        "A B C D E F",
        %{text: "Rivers flow"},
        "The end."
      ]
  end

  defp sequential(tokenizer, state, inputs),
    do: Enum.map(inputs, &unpadded(TextGeneration.run(tokenizer, state, &1, @opts).results))

  # A batched row's token_summary counts the left padding its batch-mates
  # gave it; the rest of the result equals its single run.
  defp unpadded(results),
    do: Enum.map(results, &update_in(&1.token_summary, fn s -> Map.delete(s, :padding) end))

  test "16 processes on 4 streams give the sequential greedy outputs", %{
    tokenizer: tokenizer,
    state: state
  } do
    inputs = sixteen_inputs()
    expected = sequential(tokenizer, state, inputs)
    streams = [:cpu, :cpu, :cpu, :default] |> Enum.map(&EMLXAxon.Stream.new!/1)

    for _round <- 1..2 do
      results =
        inputs
        |> Enum.with_index()
        |> Enum.map(fn {input, index} ->
          stream = Enum.at(streams, rem(index, 4))

          Task.async(fn ->
            EMLXAxon.Stream.with_stream(stream, fn ->
              unpadded(TextGeneration.run(tokenizer, state, input, @opts).results)
            end)
          end)
        end)
        |> Task.await_many(120_000)

      assert results == expected
    end
  end

  test "3x more generations than dirty schedulers, all alive at once, do not deadlock", %{
    tokenizer: tokenizer,
    state: state
  } do
    # Every generation waits, after its first chunk, until all of them have
    # started: that only works if no generation holds a dirty scheduler
    # between chunks. Half share one stream, the rest lease their own.
    count = 3 * :erlang.system_info(:dirty_cpu_schedulers)
    inputs = Enum.map(0..(count - 1), &Enum.at(sixteen_inputs(), rem(&1, 16)))
    expected = sequential(tokenizer, state, inputs)
    shared = EMLXAxon.Stream.new!(:cpu)
    coordinator = self()

    tasks =
      inputs
      |> Enum.with_index()
      |> Enum.map(fn {input, index} ->
        opts = if rem(index, 2) == 0, do: [stream: shared], else: []

        Task.async(fn ->
          emit = fn _chunk ->
            if Process.put(:started, true) == nil do
              send(coordinator, {:started, self()})
              receive do: (:go -> :ok)
            end
          end

          opts = @opts ++ [chunk_size: 1] ++ opts
          unpadded(TextGeneration.stream(tokenizer, state, input, emit, opts).results)
        end)
      end)

    for _ <- tasks, do: assert_receive({:started, _}, 60_000)
    for %Task{pid: pid} <- tasks, do: send(pid, :go)

    assert Task.await_many(tasks, 120_000) == expected
  end

  test "batched runs from many processes under load lose no request", %{
    tokenizer: tokenizer,
    state: state
  } do
    inputs = sixteen_inputs()
    expected = sequential(tokenizer, state, inputs)
    batches = inputs |> Enum.zip(expected) |> Enum.chunk_every(4)
    stream = EMLXAxon.Stream.new!(:cpu)

    batched =
      for {batch, index} <- Enum.with_index(batches), round <- 1..2 do
        {inputs, expected} = Enum.unzip(batch)
        # Alternately on a shared stream with a chunk per token, and alone.
        opts =
          if rem(index + round, 2) == 0,
            do: @opts ++ [mlx_stream: stream, chunk_size: 1],
            else: @opts

        Task.async(fn ->
          outputs = TextGeneration.run(tokenizer, state, inputs, opts)
          {Enum.map(outputs, &unpadded(&1.results)), expected}
        end)
      end

    # The load: single runs and streams alongside the batches.
    singles =
      for {input, expected} <- Enum.zip(inputs, expected) do
        Task.async(fn ->
          {unpadded(
             TextGeneration.stream(tokenizer, state, input, fn _ -> :ok end, @opts).results
           ), expected}
        end)
      end

    results = Task.await_many(batched, 120_000)
    assert length(results) == 8
    assert Enum.sum(Enum.map(results, fn {outputs, _} -> length(outputs) end)) == 32
    for {outputs, expected} <- results, do: assert(outputs == expected)
    for {output, expected} <- Task.await_many(singles, 120_000), do: assert(output == expected)
  end

  test "killing a generating process stops it within a chunk and frees its cache", %{
    tokenizer: tokenizer,
    state: state
  } do
    before = settled_active()
    parent = self()

    for chunk_size <- [1, 1, 4, 16, 1] do
      # 100,000 tokens would take many minutes: the memory can only come
      # back promptly if decoding stopped with the process.
      pid =
        spawn(fn ->
          TextGeneration.stream(
            tokenizer,
            state,
            "Tell me a story",
            fn chunk -> send(parent, {:chunk, self(), chunk}) end,
            max_new_tokens: 100_000,
            max_len: 100_100,
            ignore_eos: true,
            chunk_size: chunk_size
          )
        end)

      microseconds =
        try do
          assert_receive {:chunk, ^pid, _}, 30_000
          # Measured against the memory freed by the kill rather than the
          # baseline, which memory a test before this one frees late lowers.
          during = active()
          ref = Process.monitor(pid)
          Process.exit(pid, :kill)
          assert_receive {:DOWN, ^ref, :process, ^pid, :killed}

          {microseconds, now} = :timer.tc(fn -> await_active(before, 10_000) end)
          assert now <= before, "a killed generation kept #{now - before} bytes"
          assert during - now >= kv_bytes(state, 1, 100_000)
          microseconds
        after
          # A failed assertion must not leave a 100,000-token generation
          # running into the next tests.
          Process.exit(pid, :kill)
        end

      IO.puts(
        "\nkilled with chunk_size #{chunk_size}: cache freed in #{div(microseconds, 1000)} ms"
      )
    end

    assert %{results: [%{num_tokens: 16}]} =
             TextGeneration.run(tokenizer, state, "Hello", @opts ++ [ignore_eos: true])
  end

  test "many generations in a row, some failing, do not break anything", %{
    tokenizer: tokenizer,
    state: state
  } do
    for i <- 1..40 do
      case rem(i, 4) do
        0 ->
          assert_raise Error, ~r/prompt_too_long/, fn ->
            TextGeneration.run(tokenizer, state, "The quick brown fox jumps", max_len: 2)
          end

        1 ->
          assert_raise ArgumentError, fn ->
            TextGeneration.run(tokenizer, state, "x", max_new_tokens: 0)
          end

        2 ->
          assert_raise RuntimeError, fn ->
            TextGeneration.stream(tokenizer, state, "x", fn _ -> raise "stop" end, @opts)
          end

        3 ->
          assert {:ok, %{token_ids: [_ | _]}} =
                   Generate.generate(state, [9707], max_new_tokens: 4)
      end
    end

    assert {:error, %Error{kind: :io}} = Loader.load("/definitely/missing")
    assert %{results: [%{num_tokens: 16}]} = TextGeneration.run(tokenizer, state, "Hello", @opts)
  end

  test "a model and tokenizer can be loaded concurrently" do
    path = TestFixtures.path("qwen3-4bit-g64")

    1..6
    |> Task.async_stream(fn _ -> {Loader.load!(path), EMLXAxon.Tokenizer.load!(path)} end,
      timeout: 120_000
    )
    |> Enum.each(fn {:ok, {state, tokenizer}} ->
      assert %{results: [%{num_tokens: 4}]} =
               TextGeneration.run(tokenizer, state, "Hi", max_new_tokens: 4, ignore_eos: true)
    end)
  end

  test "a checkpoint overwritten, truncated or deleted after loading changes nothing" do
    dir = TestCheckpoint.scratch_copy("qwen3-4bit-g64")

    %{"prompt_ids" => ids, "greedy_ids" => greedy} =
      TestFixtures.reference("qwen3-4bit-g64")["prompts"]["plain"]

    # float32 as the reference ids are (the default dtype is bfloat16 on a GPU).
    state = Loader.load!(dir, dtype: :float32)
    weights = Path.join(dir, "model.safetensors")
    %{size: size} = File.stat!(weights)
    opts = [max_new_tokens: length(greedy), ignore_eos: true]

    # Undamaged first, so that a difference below can only be the damage's.
    assert {:ok, %{token_ids: ^greedy}} = Generate.generate(state, ids, opts)

    damages = [
      # In place: the same file (inode) gets new bytes, as a mapping would see.
      overwritten: fn ->
        {:ok, file} = :file.open(weights, [:read, :write, :raw, :binary])
        :ok = :file.pwrite(file, 0, :rand.bytes(size))
        :ok = :file.close(file)
      end,
      truncated: fn -> File.write!(weights, "") end,
      deleted: fn -> File.rm!(weights) end
    ]

    for {damage, fun} <- damages do
      fun.()

      assert {:ok, %{token_ids: ^greedy}} = Generate.generate(state, ids, opts),
             "after the weights were #{damage}"
    end

    assert {:error, %Error{kind: :io}} = Loader.load(dir)
  end
end
