# Runs only where Nx is available (see serving_test.exs).
if Code.ensure_loaded?(Nx.Serving) do
  defmodule EMLXAxon.HubServingTest do
    # `from_mlx4bit/3` with a Hub repository, as Bumblebee users write it:
    # the checkpoint and its tokenizer come from a stand-in Hub on
    # 127.0.0.1, once, and the serving generates the reference tokens.
    use ExUnit.Case, async: false

    alias EMLXAxon.{TestFixtures, TestHub, TextGeneration}

    @moduletag :fixtures
    @moduletag :capture_log

    @model "qwen3-4bit-g64"
    @repo "test-org/qwen3-tiny-4bit"

    setup do
      hub = TestHub.start!()
      cache = Path.join(System.tmp_dir!(), "emlx_axon_hub_#{System.unique_integer([:positive])}")
      TestHub.put_repo(hub, @repo, TestHub.checkpoint_files(TestFixtures.path(@model)))

      on_exit(fn ->
        TestHub.stop(hub)
        File.rm_rf!(cache)
      end)

      %{hub: hub, repo: {:hf, @repo, endpoint: hub.url, cache_dir: cache}}
    end

    test "from_mlx4bit downloads a Hub checkpoint and its tokenizer once, then serves", ctx do
      %{"prompt_ids" => prompt, "greedy_ids" => greedy} =
        TestFixtures.reference(@model)["prompts"]["plain"]

      serving =
        TextGeneration.from_mlx4bit(ctx.repo, nil,
          dtype: :float32,
          max_new_tokens: length(greedy),
          ignore_eos: true,
          scheduler: false
        )

      downloads =
        Enum.count(TestHub.requests(ctx.hub), &(&1.method == "GET" and &1.path =~ "/resolve/"))

      assert downloads == length(TestHub.checkpoint_names())

      %{results: [result]} = Nx.Serving.run(serving, %{input_ids: prompt})
      assert result.token_ids == greedy

      # Again from the cache: the file list only, nothing downloaded.
      _ = TextGeneration.from_mlx4bit(ctx.repo, nil, dtype: :float32, scheduler: false)

      assert Enum.count(
               TestHub.requests(ctx.hub),
               &(&1.method == "GET" and &1.path =~ "/resolve/")
             ) ==
               downloads
    end
  end
end
