defmodule EMLXAxon.HubTest do
  # Checkpoints from a stand-in Hugging Face Hub on 127.0.0.1
  # (EMLXAxon.TestHub) serving the fixture checkpoint's real files: they
  # are downloaded, checked, cached, then loaded and run through the NIF.
  use ExUnit.Case, async: false

  import ExUnit.CaptureLog

  alias EMLXAxon.{Error, Hub, TestFixtures, TestHub, TestJSON, Tokenizer}
  alias EMLXAxon.Qwen3.{Generate, Loader}

  @moduletag :fixtures
  @moduletag :capture_log

  @model "qwen3-4bit-g64"
  @repo "test-org/qwen3-tiny-4bit"
  @files TestHub.checkpoint_names()
  @tokenizer_files ~w(tokenizer.json tokenizer_config.json generation_config.json)

  setup_all do
    files = TestHub.checkpoint_files(TestFixtures.path(@model))
    # Files a checkpoint does not need: listed by the Hub, never downloaded.
    extra = %{"README.md" => "# A tiny Qwen3\n", "reference.safetensors" => "not weights"}

    %{"prompt_ids" => prompt, "greedy_ids" => greedy} =
      TestFixtures.reference(@model)["prompts"]["plain"]

    %{files: files, all_files: Map.merge(files, extra), prompt: prompt, greedy: greedy}
  end

  setup ctx do
    hub = TestHub.start!()
    cache = Path.join(System.tmp_dir!(), "emlx_axon_hub_#{System.unique_integer([:positive])}")

    on_exit(fn ->
      TestHub.stop(hub)
      File.rm_rf!(cache)
    end)

    commit = TestHub.put_repo(hub, @repo, ctx.all_files)
    %{hub: hub, cache: cache, commit: commit, opts: [endpoint: hub.url, cache_dir: cache]}
  end

  defp repo(ctx, extra \\ []), do: {:hf, @repo, ctx.opts ++ extra}

  defp gets(hub), do: hub |> TestHub.requests() |> Enum.map(&{&1.method, &1.path})

  defp resolve_path(commit, file), do: "/#{@repo}/resolve/#{commit}/#{file}"

  defp assert_generates_reference(state, ctx) do
    assert {:ok, %{token_ids: ids}} =
             Generate.generate(state, ctx.prompt,
               max_new_tokens: length(ctx.greedy),
               ignore_eos: true
             )

    assert ids == ctx.greedy
  end

  test "downloads a checkpoint into the cache, then loads and runs it", ctx do
    log =
      capture_log(fn ->
        assert {:ok, state} = Loader.load(repo(ctx), dtype: :float32)
        send(self(), {:state, state})
      end)

    assert_received {:state, state}

    snapshot =
      Path.join([ctx.cache, "models--test-org--qwen3-tiny-4bit", "snapshots", ctx.commit])

    assert state.path == snapshot
    assert_generates_reference(state, ctx)

    # Every file of the checkpoint, byte for byte, linked from the snapshot
    # to a blob named by its ETag; nothing else was fetched.
    for name <- @files do
      path = Path.join(snapshot, name)
      assert File.read!(path) == ctx.files[name], name
      assert {:ok, %File.Stat{type: :symlink}} = File.lstat(path)

      etag =
        if String.ends_with?(name, ".safetensors"),
          do: TestHub.sha256(ctx.files[name]),
          else: TestHub.git_oid(ctx.files[name])

      assert File.read!(
               Path.join([ctx.cache, "models--test-org--qwen3-tiny-4bit", "blobs", etag])
             ) == ctx.files[name]
    end

    assert File.ls!(snapshot) |> Enum.sort() == Enum.sort(@files)

    assert File.read!(Path.join([ctx.cache, "models--test-org--qwen3-tiny-4bit", "refs", "main"])) ==
             ctx.commit

    requests = gets(ctx.hub)
    assert hd(requests) == {"GET", "/api/models/#{@repo}/revision/main?blobs=true"}

    for name <- @files do
      assert {"GET", resolve_path(ctx.commit, name)} in requests
      assert log =~ "Downloaded #{name} of #{@repo}"
    end

    # The weights came through the redirect to the blob store.
    assert {"GET", "/cdn/#{TestHub.sha256(ctx.files["model.safetensors"])}"} in requests
    refute Enum.any?(requests, fn {_, path} -> path =~ ~r/README|reference/ end)
    assert length(requests) == 1 + length(@files) + 1

    # The tokenizer from the same cache: only the file list is asked for.
    TestHub.clear_requests(ctx.hub)
    assert {:ok, tokenizer} = Tokenizer.load(repo(ctx))
    assert tokenizer.path == snapshot
    assert gets(ctx.hub) == [{"GET", "/api/models/#{@repo}/revision/main?blobs=true"}]

    assert {:ok, ids} =
             Tokenizer.encode(tokenizer, "The quick brown fox jumps over the lazy dog.")

    assert ids == ctx.prompt
    assert {:ok, text} = Tokenizer.decode(tokenizer, ctx.greedy)

    %{results: [%{generated_text: ^text}]} =
      EMLXAxon.TextGeneration.run(tokenizer, state, %{input_ids: ctx.prompt},
        max_new_tokens: length(ctx.greedy),
        ignore_eos: true
      )
  end

  test "a tokenizer alone downloads only the tokenizer's files", ctx do
    assert {:ok, tokenizer} = Tokenizer.load(repo(ctx))

    assert {:ok, ids} =
             Tokenizer.encode(tokenizer, "The quick brown fox jumps over the lazy dog.")

    assert ids == ctx.prompt

    fetched =
      for {"GET", "/" <> _ = path} <- gets(ctx.hub), path =~ "/resolve/", do: Path.basename(path)

    assert Enum.sort(fetched) == Enum.sort(@tokenizer_files)
  end

  test "a cached checkpoint is not downloaded again; a new commit fetches only what changed",
       ctx do
    assert {:ok, dir} = Hub.fetch(repo(ctx))
    TestHub.clear_requests(ctx.hub)

    assert {:ok, ^dir} = Hub.fetch(repo(ctx))
    assert gets(ctx.hub) == [{"GET", "/api/models/#{@repo}/revision/main?blobs=true"}]

    # A new commit with another config.json: the other blobs are reused by ETag.
    config = ctx.files["config.json"] <> "\n"
    new_commit = TestHub.put_repo(ctx.hub, @repo, Map.put(ctx.all_files, "config.json", config))
    TestHub.clear_requests(ctx.hub)

    assert {:ok, new_dir} = Hub.fetch(repo(ctx))
    assert new_dir != dir and Path.basename(new_dir) == new_commit

    assert gets(ctx.hub) == [
             {"GET", "/api/models/#{@repo}/revision/main?blobs=true"},
             {"GET", resolve_path(new_commit, "config.json")}
           ]

    assert File.read!(Path.join(new_dir, "config.json")) == config
    assert File.read!(Path.join(dir, "config.json")) == ctx.files["config.json"]
    assert {:ok, state} = Loader.load(new_dir, dtype: :float32)
    assert_generates_reference(state, ctx)

    # A revision pinned to the first commit is still its snapshot.
    assert {:ok, ^dir} = Hub.fetch(repo(ctx, revision: ctx.commit))
  end

  test "offline: from the cache with no request, and a clear error for what it lacks", ctx do
    assert {:error, %Error{kind: :offline, message: message}} =
             Hub.fetch(repo(ctx, offline: true))

    assert message =~ @repo
    assert message =~ "offline"

    assert {:ok, dir} = Hub.fetch(repo(ctx))
    TestHub.clear_requests(ctx.hub)

    assert {:ok, ^dir} = Hub.fetch(repo(ctx, offline: true))
    assert {:ok, state} = Loader.load(repo(ctx, offline: true), dtype: :float32)
    assert_generates_reference(state, ctx)

    # HF_HUB_OFFLINE=1 does the same.
    previous = System.get_env("HF_HUB_OFFLINE")
    System.put_env("HF_HUB_OFFLINE", "1")

    try do
      assert {:ok, ^dir} = Hub.fetch(repo(ctx), :tokenizer)
      assert {:ok, _tokenizer} = Tokenizer.load(repo(ctx))
    after
      if previous,
        do: System.put_env("HF_HUB_OFFLINE", previous),
        else: System.delete_env("HF_HUB_OFFLINE")
    end

    assert gets(ctx.hub) == []

    # A missing blob makes the snapshot incomplete, and offline says which file.
    File.rm!(Path.join(dir, "model.safetensors"))

    assert {:error, %Error{kind: :offline, message: message}} =
             Hub.fetch(repo(ctx, offline: true))

    assert message =~ "model.safetensors is missing"

    # Another revision was never fetched.
    assert {:error, %Error{kind: :offline}} = Hub.fetch(repo(ctx, offline: true, revision: "v2"))
  end

  test "when the Hub cannot be reached, the cached snapshot is used", ctx do
    assert {:ok, dir} = Hub.fetch(repo(ctx))
    TestHub.stop(ctx.hub)

    log = capture_log(fn -> assert {:ok, ^dir} = Hub.fetch(repo(ctx)) end)
    assert log =~ "could not be reached"

    assert {:error, %Error{kind: :network, message: message}} =
             Hub.fetch(repo(ctx, revision: "never-fetched"))

    assert message =~ @repo
  end

  test "404: a missing repository, revision or file is named", ctx do
    assert {:error, %Error{kind: :not_found, message: message}} =
             Hub.fetch({:hf, "test-org/no-such-model", ctx.opts})

    assert message =~ "test-org/no-such-model"
    assert message =~ "404"

    assert {:error, %Error{kind: :not_found, message: message}} =
             Hub.fetch(repo(ctx, revision: "v9"))

    assert message =~ "revision v9"

    # An index naming a shard the repository does not have.
    index =
      EMLXAxon.JSON.encode!(%{
        weight_map: %{"model.embed_tokens.weight" => "model-00002-of-00002.safetensors"}
      })

    files = Map.put(ctx.files, "model.safetensors.index.json", index)
    commit = TestHub.put_repo(ctx.hub, "test-org/broken", files)

    assert {:error, %Error{kind: :not_found, message: message}} =
             Loader.load({:hf, "test-org/broken", ctx.opts})

    assert message =~
             "model-00002-of-00002.safetensors of the Hugging Face repository test-org/broken"

    assert message =~ "404"

    # Asked for by HEAD, as the listing did not name it.
    assert {"HEAD", "/test-org/broken/resolve/#{commit}/model-00002-of-00002.safetensors"} in gets(
             ctx.hub
           )

    # A repository without config.json.
    TestHub.put_repo(ctx.hub, "test-org/no-config", Map.delete(ctx.files, "config.json"))

    assert {:error, %Error{kind: :not_found, message: message}} =
             Hub.fetch({:hf, "test-org/no-config", ctx.opts})

    assert message =~ "config.json of the Hugging Face repository test-org/no-config"
  end

  test "a connection dropped mid-file is resumed where it stopped", ctx do
    weights = ctx.files["model.safetensors"]
    cut = 1_000_000
    TestHub.put_faults(ctx.hub, @repo, "model.safetensors", [{:drop_after, cut}])

    assert {:ok, dir} = Hub.fetch(repo(ctx))
    assert File.read!(Path.join(dir, "model.safetensors")) == weights

    cdn = "/cdn/#{TestHub.sha256(weights)}"
    ranges = for %{path: ^cdn, range: range} <- TestHub.requests(ctx.hub), do: range
    assert ranges == [nil, "bytes=#{cut}-"]
    assert Path.wildcard(Path.join(ctx.cache, "**/*.part")) == []
  end

  test "a connection that keeps dropping is a clear error; the next call resumes", ctx do
    weights = ctx.files["model.safetensors"]
    cut = 2_000_000
    faults = [{:drop_after, cut} | List.duplicate({:drop_after, 0}, 20)]
    TestHub.put_faults(ctx.hub, @repo, "model.safetensors", faults)

    assert {:error, %Error{kind: :network, message: message}} = Loader.load(repo(ctx))
    assert message =~ "model.safetensors of the Hugging Face repository #{@repo}"
    assert message =~ "attempts"

    # Nothing under the final names; the partial download is kept, and is
    # the start of the file.
    blob =
      Path.join([ctx.cache, "models--test-org--qwen3-tiny-4bit", "blobs", TestHub.sha256(weights)])

    refute File.exists?(blob)

    refute File.exists?(
             Path.join([
               ctx.cache,
               "models--test-org--qwen3-tiny-4bit",
               "snapshots",
               ctx.commit,
               "model.safetensors"
             ])
           )

    refute File.exists?(
             Path.join([ctx.cache, "models--test-org--qwen3-tiny-4bit", "refs", "main"])
           )

    assert File.read!(blob <> ".part") == binary_part(weights, 0, cut)
    assert message =~ blob <> ".part"

    TestHub.put_faults(ctx.hub, @repo, "model.safetensors", [])
    TestHub.clear_requests(ctx.hub)
    assert {:ok, state} = Loader.load(repo(ctx), dtype: :float32)
    assert_generates_reference(state, ctx)

    cdn = "/cdn/#{TestHub.sha256(weights)}"
    assert [%{range: range}] = for(%{path: ^cdn} = r <- TestHub.requests(ctx.hub), do: r)
    assert range == "bytes=#{cut}-"
  end

  test "a download that fails its checksum is discarded", ctx do
    # config.json first: it is the first file fetched, so nothing is cached yet.
    for {file, check} <- [{"config.json", "git blob id"}, {"model.safetensors", "sha256"}] do
      TestHub.put_faults(ctx.hub, @repo, file, [:corrupt])

      assert {:error, %Error{kind: :checksum, message: message}} = Hub.fetch(repo(ctx))
      assert message =~ "#{file} of the Hugging Face repository #{@repo}"
      assert message =~ "expected #{check}"

      etag =
        if check == "sha256",
          do: TestHub.sha256(ctx.files[file]),
          else: TestHub.git_oid(ctx.files[file])

      blob = Path.join([ctx.cache, "models--test-org--qwen3-tiny-4bit", "blobs", etag])
      refute File.exists?(blob)
      refute File.exists?(blob <> ".part")

      refute File.exists?(
               Path.join([
                 ctx.cache,
                 "models--test-org--qwen3-tiny-4bit",
                 "snapshots",
                 ctx.commit,
                 file
               ])
             )
    end

    # The same call, once the bytes arrive intact, succeeds.
    assert {:ok, state} = Loader.load(repo(ctx), dtype: :float32)
    assert_generates_reference(state, ctx)
  end

  test "a private repository: 401 without a token, read with one", ctx do
    cdn = TestHub.start!()
    on_exit(fn -> TestHub.stop(cdn) end)
    TestHub.put_repo(cdn, "test-org/private", ctx.files)
    TestHub.put_repo(ctx.hub, "test-org/private", ctx.files, token: "s3cret", cdn: cdn)
    private = fn extra -> {:hf, "test-org/private", ctx.opts ++ extra} end

    previous = System.get_env("HF_TOKEN")
    System.delete_env("HF_TOKEN")

    try do
      assert {:error, %Error{kind: :unauthorized, message: message}} = Loader.load(private.([]))
      assert message =~ "test-org/private"
      assert message =~ "401"
      assert message =~ "auth_token"

      assert {:error, %Error{kind: :unauthorized, message: message}} =
               Tokenizer.load(private.(auth_token: "wrong"))

      assert message =~ "token given"

      assert {:ok, state} = Loader.load(private.(auth_token: "s3cret"), dtype: :float32)
      assert_generates_reference(state, ctx)

      # The token goes to the Hub, never to the other host the weights
      # are redirected to.
      assert Enum.all?(
               TestHub.requests(ctx.hub),
               &(&1.authorization in [nil, "Bearer s3cret", "Bearer wrong"])
             )

      assert [_ | _] = cdn_requests = TestHub.requests(cdn)
      assert Enum.all?(cdn_requests, &(&1.authorization == nil))

      # HF_TOKEN is the default token.
      System.put_env("HF_TOKEN", "s3cret")
      assert {:ok, _} = Tokenizer.load(private.([]))
    after
      if previous, do: System.put_env("HF_TOKEN", previous), else: System.delete_env("HF_TOKEN")
    end
  end

  test "a sharded checkpoint is fetched through its index", ctx do
    shards = TestHub.shard!(Path.join(TestFixtures.path(@model), "model.safetensors"), 3)
    files = ctx.files |> Map.delete("model.safetensors") |> Map.merge(shards)
    TestHub.put_repo(ctx.hub, "test-org/sharded", files)

    assert {:ok, state} = Loader.load({:hf, "test-org/sharded", ctx.opts}, dtype: :float32)
    assert_generates_reference(state, ctx)

    names = shards |> Map.keys() |> Enum.filter(&String.ends_with?(&1, ".safetensors"))
    assert length(names) == 3
    assert Enum.sort(File.ls!(state.path)) == Enum.sort(Map.keys(files))
  end

  test "progress: a callback per file and a log line per download", ctx do
    parent = self()
    progress = fn event -> send(parent, {:progress, event}) end

    log = capture_log(fn -> assert {:ok, _} = Hub.fetch(repo(ctx, progress: progress)) end)

    events = collect_progress([])
    weights = Enum.filter(events, &(&1.file == "model.safetensors"))
    size = byte_size(ctx.files["model.safetensors"])
    assert %{bytes: 0, total: ^size, repo: @repo, revision: "main"} = hd(weights)
    assert %{bytes: ^size, total: ^size} = List.last(weights)
    assert weights == Enum.sort_by(weights, & &1.bytes)

    for name <- @files do
      assert Enum.any?(events, &(&1.file == name))
      assert length(Regex.scan(~r/Downloaded #{Regex.escape(name)} of/, log)) == 1
    end
  end

  defp collect_progress(acc) do
    receive do
      {:progress, event} -> collect_progress([event | acc])
    after
      0 -> Enum.reverse(acc)
    end
  end

  test "the cache folder: EMLX_AXON_CACHE_DIR, else XDG_CACHE_HOME, else ~/.cache" do
    saved = for var <- ~w(EMLX_AXON_CACHE_DIR XDG_CACHE_HOME), do: {var, System.get_env(var)}

    try do
      System.put_env("EMLX_AXON_CACHE_DIR", "/tmp/emlx-axon-cache")
      System.put_env("XDG_CACHE_HOME", "/tmp/xdg")
      assert Hub.cache_dir() == "/tmp/emlx-axon-cache"
      System.delete_env("EMLX_AXON_CACHE_DIR")
      assert Hub.cache_dir() == "/tmp/xdg/emlx_axon"
      System.delete_env("XDG_CACHE_HOME")
      assert Hub.cache_dir() == Path.expand("~/.cache/emlx_axon")
    after
      for {var, value} <- saved,
          do: if(value, do: System.put_env(var, value), else: System.delete_env(var))
    end
  end

  test "bad repositories and options raise ArgumentError naming them", ctx do
    assert_raise ArgumentError, ~r/unknown option :bogus.*valid options are/, fn ->
      Hub.fetch(repo(ctx, bogus: 1))
    end

    assert_raise ArgumentError, ~r/Hugging Face repository id/, fn ->
      Loader.load({:hf, "../etc"})
    end

    assert_raise ArgumentError, ~r/:revision/, fn -> Hub.fetch(repo(ctx, revision: "../x")) end
    assert_raise ArgumentError, ~r/:offline/, fn -> Tokenizer.load(repo(ctx, offline: "yes")) end

    assert_raise ArgumentError, ~r/:endpoint/, fn ->
      Hub.fetch({:hf, @repo, endpoint: "ftp://x"})
    end

    assert_raise ArgumentError, ~r/:progress/, fn -> Hub.fetch(repo(ctx, progress: 1)) end

    assert_raise ArgumentError, ~r/:checkpoint or :tokenizer/, fn ->
      Hub.fetch(repo(ctx), :all)
    end

    # Loader options are checked before anything is downloaded.
    assert_raise ArgumentError, ~r/:dtype/, fn -> Loader.load(repo(ctx), dtype: :int8) end
    assert gets(ctx.hub) == []
  end

  test "mix emlx_axon.generate --model hf:REPO (scripts/generate's path), through HF_ENDPOINT",
       ctx do
    env = [
      {"HF_ENDPOINT", ctx.hub.url},
      {"EMLX_AXON_CACHE_DIR", ctx.cache},
      {"MIX_ENV", "test"},
      {"HF_HUB_OFFLINE", nil},
      {"HF_TOKEN", nil}
    ]

    args = ["emlx_axon.generate", "--model", "hf:" <> @repo, "--dtype", "float32"]
    ids = Enum.join(ctx.prompt, ",")
    n = length(ctx.greedy)

    {output, status} =
      System.cmd("mix", args ++ ["--prompt-ids", ids, "--max-new-tokens", "#{n}"],
        cd: TestFixtures.root(),
        env: env,
        stderr_to_stdout: true
      )

    assert status == 0, output
    {:ok, text} = Tokenizer.decode(TestFixtures.tokenizer(@model), ctx.greedy)
    assert output =~ ~r/Downloading model.safetensors: [\d.]+\/10.6 MiB\n/
    assert output =~ text <> "\n-- #{n} tokens (length)"

    # From the cache now: with --json, stdout holds the JSON object alone.
    {output, status} =
      System.cmd("mix", args ++ ["--prompt-ids", ids, "--max-new-tokens", "#{n}", "--json"],
        cd: TestFixtures.root(),
        env: env
      )

    assert status == 0, output
    assert [line] = String.split(output, "\n", trim: true)
    assert %{"generated_ids" => generated, "text" => ^text} = TestJSON.decode!(line)
    assert generated == ctx.greedy
  end
end
