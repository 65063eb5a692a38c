defmodule EMLXAxon.ReliabilityTest do
  # Not async: these tests load the machine on purpose.
  use ExUnit.Case, async: false

  alias EMLXAxon.{Error, TestFixtures, TextGeneration}
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

  test "8 processes on 2 streams give the sequential greedy outputs", %{
    tokenizer: tokenizer,
    state: state
  } do
    inputs = inputs()
    expected = Enum.map(inputs, &TextGeneration.run(tokenizer, state, &1, @opts).results)
    streams = [EMLXAxon.Stream.new!(:cpu), EMLXAxon.Stream.new!(:default)]

    for _round <- 1..3 do
      results =
        inputs
        |> Enum.with_index()
        |> Enum.map(fn {input, index} ->
          stream = Enum.at(streams, rem(index, 2))

          Task.async(fn ->
            EMLXAxon.Stream.with_stream(stream, fn ->
              TextGeneration.run(tokenizer, state, input, @opts).results
            end)
          end)
        end)
        |> Task.await_many(120_000)

      assert results == expected
    end
  end

  test "concurrent streaming and batched runs agree with sequential runs", %{
    tokenizer: tokenizer,
    state: state
  } do
    inputs = inputs()
    expected = Enum.map(inputs, &TextGeneration.run(tokenizer, state, &1, @opts).results)
    stream = EMLXAxon.Stream.new!(:cpu)

    tasks = [
      Task.async(fn ->
        tokenizer |> TextGeneration.run(state, inputs, @opts) |> Enum.map(& &1.results)
      end),
      Task.async(fn ->
        Enum.map(inputs, fn input ->
          TextGeneration.stream(
            tokenizer,
            state,
            input,
            fn _ -> :ok end,
            @opts ++ [stream: stream]
          ).results
        end)
      end),
      Task.async(fn ->
        tokenizer
        |> TextGeneration.run(state, inputs, @opts ++ [mlx_stream: stream, chunk_size: 1])
        |> Enum.map(& &1.results)
      end)
    ]

    for result <- Task.await_many(tasks, 120_000), do: assert(result == expected)
  end

  test "killing a generating process frees it and the VM carries on", %{
    tokenizer: tokenizer,
    state: state
  } do
    parent = self()

    for _ <- 1..5 do
      pid =
        spawn(fn ->
          TextGeneration.stream(
            tokenizer,
            state,
            "Tell me a story",
            fn chunk -> send(parent, {:chunk, self(), chunk}) end,
            max_new_tokens: 1000,
            max_len: 2048,
            ignore_eos: true,
            chunk_size: 1
          )
        end)

      assert_receive {:chunk, ^pid, _}, 30_000
      Process.exit(pid, :kill)
    end

    :erlang.garbage_collect()
    assert %{results: [%{num_tokens: 16}]} = TextGeneration.run(tokenizer, state, "Hello", @opts)
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

  test "generating from many processes at once", %{tokenizer: tokenizer, state: state} do
    expected = TextGeneration.run(tokenizer, state, "Hello", @opts).results

    1..24
    |> Task.async_stream(fn _ -> TextGeneration.run(tokenizer, state, "Hello", @opts).results end,
      max_concurrency: 12,
      timeout: 120_000
    )
    |> Enum.each(fn {:ok, results} -> assert results == expected end)
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
end
